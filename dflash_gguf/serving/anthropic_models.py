"""Anthropic's Messages API requests as pydantic models (anthropic_api.to_openai reads
them into the chat form the server speaks). As for the OpenAI API (openai_models):
unknown fields ignored (cache_control, metadata, citations...), JSON's types strict.

A message's content blocks are a union keyed on their `type`, one per role: what a
user turn carries (text, tool results) and what an assistant turn does (text,
thinking, tool calls). Images and documents are known, and refused by name: this
model reads text only."""
from __future__ import annotations

from typing import Annotated, List, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .api_errors import refusal
from .openai_models import Stop, Strict, Temperature, TokenCount, ToolName, TopP, flag


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class UnreadableBlock(Strict):
    type: Literal["image", "document"]

    @model_validator(mode="after")
    def _text_only(self):
        raise refusal("text_only", "is {what} content: this model reads text only", what=repr(self.type))


TextContent = Annotated[Union[TextBlock, UnreadableBlock], Field(discriminator="type")]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, List[TextContent]] = ""
    is_error: Optional[bool] = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(Strict):
    """Thinking encrypted for another model: nothing this one can read."""

    type: Literal["redacted_thinking"]


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


UserBlock = Annotated[Union[TextBlock, ToolResultBlock, UnreadableBlock], Field(discriminator="type")]
AssistantBlock = Annotated[Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock],
                           Field(discriminator="type")]


class UserMessage(Strict):
    role: Literal["user"]
    content: Union[str, List[UserBlock]]


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Union[str, List[AssistantBlock]]


Message = Annotated[Union[UserMessage, AssistantMessage], Field(discriminator="role")]


class Tool(Strict):
    name: ToolName
    description: str = ""
    input_schema: dict = Field(default_factory=dict)
    type: Optional[str] = None  # "custom", or one of Anthropic's server tools
    strict: Optional[bool] = None

    @field_validator("type")
    @classmethod
    def _custom_only(cls, kind: Optional[str]) -> Optional[str]:
        if kind not in (None, "custom"):
            raise refusal("server_tool", "is {what}: server tools are not supported", what=repr(kind))
        return kind


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: flag(False) = False

    @model_validator(mode="after")
    def _tool_named(self):
        if self.type == "tool" and self.name is None:
            raise refusal("tool_choice", "of type 'tool' needs a 'name'")
        return self


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: Optional[Annotated[int, Field(ge=1)]] = None


class ThinkingOther(Strict):
    type: Literal["disabled", "adaptive"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingOther], Field(discriminator="type")]


class MessagesRequest(Strict):
    messages: List[Message]  # empty is taken, as llama-server takes it (Anthropic's API refuses it)
    max_tokens: TokenCount
    system: Union[str, List[TextContent], None] = None
    stop_sequences: Optional[Stop] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[int] = None
    stream: flag(False) = False
    chat_template_kwargs: Optional[dict] = None  # llama-server's, checked as the chat request's
    thinking: Optional[Thinking] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
