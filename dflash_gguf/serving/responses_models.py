"""OpenAI's Responses API requests (POST /v1/responses), the subset llama-server takes,
as pydantic models; responses_api.to_chat reads them into the chat request the server
speaks. As for the chat API (openai_models): unknown fields ignored, JSON's types strict.

`input` is a string (one user message) or a list of items, told apart by their shape
as llama-server tells them: a message (by its role: user, system and developer give
input parts, assistant gives output parts), a function call, a function call's output,
a reasoning item. Images and files are known, and refused by name: this model reads
text only. The Responses fields that need state a server keeps (previous_response_id,
conversation) are refused too: this server keeps no responses."""
from __future__ import annotations

from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from .api_errors import refusal
from .openai_models import ReasoningEffort, Strict, TokenCount, ToolName, _arguments, flag


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class UnreadableInput(Strict):
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _text_only(self):
        raise refusal("text_only", "is {what} content: this model reads text only", what=repr(self.type))


InputPart = Annotated[Union[InputText, UnreadableInput], Field(discriminator="type")]


class OutputText(Strict):
    type: Literal["output_text", "input_text"]  # llama-server takes both in an assistant's message
    text: str


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


OutputPart = Annotated[Union[OutputText, RefusalPart], Field(discriminator="type")]


class InputMessage(Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer"]
    content: Union[str, List[InputPart]]


class OutputMessage(Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["assistant"]
    content: Union[str, List[OutputPart]]


def _object_text(text: str) -> str:
    """A call's arguments: JSON text of an object (the chat request reads it again)."""
    _arguments(text)
    return text


class FunctionCall(Strict):
    type: Literal["function_call"]
    call_id: str
    name: Annotated[str, Field(min_length=1)]
    arguments: Annotated[str, AfterValidator(_object_text)]


class FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, List[InputPart]]


class ReasoningText(Strict):
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    content: Annotated[List[ReasoningText], Field(min_length=1)]


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(item: Any) -> Optional[str]:
    """An input item's kind: a message by its role, any other item by its type."""
    if not isinstance(item, dict):
        return None
    if "role" in item and item.get("type") in (None, "message"):
        return "assistant" if item["role"] == "assistant" else "input"
    kind = item.get("type")
    return kind if kind in ITEM_KINDS[1:] else None


Item = Annotated[Union[Annotated[InputMessage, Tag("input")], Annotated[OutputMessage, Tag("assistant")],
                       Annotated[FunctionCall, Tag("function_call")],
                       Annotated[FunctionCallOutput, Tag("function_call_output")],
                       Annotated[ReasoningItem, Tag("reasoning")]],
                 Discriminator(_item_kind, custom_error_type="dflash_item",
                               custom_error_message="is none of the input items this server reads: a message (with "
                                                    "a 'role'), a 'function_call', a 'function_call_output' or a "
                                                    "'reasoning' item")]


class FunctionTool(Strict):
    type: Literal["function"]
    name: ToolName
    description: str = ""
    parameters: Optional[dict] = None
    strict: Optional[bool] = None  # as the chat API's: true holds the calls' arguments to the parameters


class OtherTool(Strict):
    """A tool of another type (web search, file search, ...): no chat equivalent, passed
    over as llama-server passes it over."""

    type: str


def _tool_kind(tool: Any) -> Optional[str]:
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        return None
    return "function" if tool["type"] == "function" else "other"


ResponsesTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[OtherTool, Tag("other")]],
                          Discriminator(_tool_kind, custom_error_type="dflash_tool",
                                        custom_error_message="needs a 'type' ('function' for a function tool)")]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    schema_: Optional[dict] = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise refusal("schema", "of type 'json_schema' needs a 'schema'")
        return self


class TextOptions(Strict):
    format: Optional[TextFormat] = None


class ReasoningOptions(Strict):
    effort: Optional[ReasoningEffort] = None


class ResponsesRequest(Strict):
    """The Responses fields; the others (stop, seed, top_k, chat_template_kwargs, ...) go
    to the chat request as they are, as llama-server passes them."""

    input: Union[str, List[Item]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[TokenCount] = None
    stream: flag(False) = False
    tools: Optional[List[ResponsesTool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], FunctionChoice]] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None

    @model_validator(mode="after")
    def _stateless(self):
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) not in (None, ""):
                raise refusal("stateless", "'{param}' is not supported: this server keeps no responses or "
                                           "conversations; send the whole conversation as 'input'", param=name)
        return self
