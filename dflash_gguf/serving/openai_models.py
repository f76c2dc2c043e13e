"""The OpenAI API's requests, with llama-server's fields and endpoints beside them, as
pydantic models: a request is checked here, once, and the handlers read the model.

Unknown fields are ignored, as the API and llama-server ignore them; the fields whose
meaning this server does not implement are refused instead (UNSUPPORTED), so that a
client is not misled. Values are strict: JSON has types, and "10" is not read as 10 nor
1 as true. A null field is the server's default."""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import Annotated, Any, ClassVar, List, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator,
                      model_validator)

from ..chat.reasoning import REASONING_EFFORTS, REASONING_FORMATS
from ..decoding.constraints import check_constraint
from ..decoding.sampling import SamplingParams
from ..runtime.errors import ConfigError
from .api_errors import refusal

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128  # the OpenAI API's own limit
MAX_CHOICES = 16  # a request's n: each choice is a job of the server's queue (--queue, default 16)
MAX_STOPS = 16
DEFAULT_TOP_LOGPROBS = 20  # llama-server's, for logprobs true without top_logprobs
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")  # what the call formats can carry

# fields whose meaning this server does not implement: refused rather than ignored (WHY: the reason, when there is more
# to say)
UNSUPPORTED = {
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "functions": lambda v: v is not None,  # the API's deprecated form of tools
    "function_call": lambda v: v is not None,
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
}
WHY: dict = {}


class Strict(BaseModel):
    """A request or a part of one: JSON's types as given, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


def flag(default: bool):
    """A true/false field whose null is its default, as llama-server reads one."""
    return Annotated[bool, BeforeValidator(lambda v: default if v is None else v)]


# the sampling fields' ranges: those sampling.check_sampling holds every caller to (sampling.RULES)
Finite = Annotated[float, Field(allow_inf_nan=False)]
Temperature = Annotated[Finite, Field(ge=0)]
TopP = Annotated[Finite, Field(gt=0, le=1)]
MinP = Annotated[Finite, Field(ge=0, lt=1)]
Penalty = Annotated[Finite, Field(ge=-2, le=2)]
RepeatPenalty = Annotated[Finite, Field(gt=0)]
RepeatLastN = Annotated[int, Field(ge=-1)]  # -1: the whole context, 0: no penalties
TokenCount = Annotated[int, Field(ge=0)]
MAX_PROBS = 100  # alternatives a token may list (OpenAI's top_logprobs: 20; llama-server's n_probs: unbounded)
Probs = Annotated[int, Field(ge=0, le=MAX_PROBS)]
Stop = Union[str, Annotated[List[str], Field(max_length=MAX_STOPS)]]
ReasoningEffort = Literal[REASONING_EFFORTS]


def _one_bias(value: Any) -> float:
    """A logit bias's value: a finite number, or false (never: -inf), as llama-server reads it."""
    if value is False:
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise refusal("logit_bias", "a bias must be a finite number, or false (never), got {value}",
                      value=json.dumps(value))
    return float(value)


def _logit_bias(value: Any) -> Any:
    """logit_bias as (token id or text, bias) pairs: OpenAI's {"id": bias} (llama-server's
    also takes a text as the key), or llama-server's [[id or "text", bias], ...]; a text
    stands for each of its tokens (the server tokenizes it)."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = [(int(k) if re.fullmatch(r"-?[0-9]+", k) else k, v) for k, v in value.items()]
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise refusal("logit_bias", "must be an object of token ids to biases, or a list of [token id or text, "
                                    "bias] pairs")
    pairs = []
    for key, bias in items:
        if isinstance(key, bool) or not isinstance(key, (int, str)) or isinstance(key, int) and key < 0:
            raise refusal("logit_bias", "a biased token must be a token id (>= 0) or a text, got {key}",
                          key=json.dumps(key))
        pairs.append((key, _one_bias(bias)))
    return pairs


def _tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise refusal("tool_name", "must be 1-128 letters, digits, '_', '-', '.' or ':'")
    return name


ToolName = Annotated[str, AfterValidator(_tool_name)]


# -- response formats ---------------------------------------------------------------------------

class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]
    schema_: Optional[Union[dict, str]] = Field(None, alias="schema")


class JsonSchemaSpec(Strict):
    schema_: Union[dict, str] = Field(alias="schema")
    strict: Optional[bool] = None  # strict or not, the schema is enforced


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


# -- the fields of every generating request -----------------------------------------------------

class StreamOptions(Strict):
    include_usage: flag(False) = False


class SamplingFields(Strict):
    """A request's sampling fields, read from the body beside the others (Generation
    gathers them): OpenAI's, llama.cpp's top_k and min_p, and llama.cpp's penalties:
    OpenAI's presence/frequency fields, the repetition penalty under vLLM's name or
    llama.cpp's, and llama.cpp's window."""

    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[int] = None  # <= 0: off, as in llama.cpp
    min_p: Optional[MinP] = None
    seed: Optional[int] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepeatPenalty] = None
    repeat_penalty: Optional[RepeatPenalty] = None
    repeat_last_n: Optional[RepeatLastN] = None

    @model_validator(mode="after")
    def _one_repeat_penalty(self):
        if None not in (self.repetition_penalty, self.repeat_penalty) and \
                self.repetition_penalty != self.repeat_penalty:
            raise refusal("repeat_penalty", "'repetition_penalty' and 'repeat_penalty' name the same setting: give "
                                            "one, or the same value", param="repeat_penalty")
        return self

    def params(self, defaults: SamplingParams) -> SamplingParams:
        """These fields over the server's defaults."""
        asked = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                 "top_k": None if self.top_k is None else max(self.top_k, 0),
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repeat_penalty": self.repetition_penalty if self.repeat_penalty is None else self.repeat_penalty,
                 "repeat_last_n": self.repeat_last_n}
        return replace(defaults, **{name: value for name, value in asked.items() if value is not None})


class ConstraintFields(Strict):
    """A request's constraint, read from the body beside the other fields (Generation
    gathers them): OpenAI's response_format, or llama-server's GBNF grammar or JSON
    schema; compiled as it is read, so that a bad grammar or schema is refused with the
    request (`compiled`: a constraints.Constraint, or None)."""

    response_format: Optional[ResponseFormat] = None
    grammar: Optional[str] = None
    json_schema: Optional[Union[dict, str]] = None
    _compiled: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _compile(self):
        asked = [name for name in ("response_format", "grammar", "json_schema")
                 if getattr(self, name) not in (None, "") and not isinstance(getattr(self, name), TextFormat)]
        if len(asked) > 1:
            raise refusal("constraints", "give one of 'response_format', 'grammar' and 'json_schema', not "
                                         + " and ".join(asked), param=asked[1])
        if not asked:
            return self
        name, fmt = asked[0], self.response_format
        grammar, schema = None, None
        if name == "grammar":
            grammar = self.grammar
        elif name == "json_schema":
            schema = self.json_schema
        elif isinstance(fmt, JsonObjectFormat):  # any object, or llama-server's schema beside the type
            schema = fmt.schema_ or {"type": "object"}
        else:
            schema = fmt.json_schema.schema_
        try:
            self._compiled = check_constraint(grammar, schema)
        except ConfigError as e:
            raise refusal("constraint", "{reason}", reason=str(e), param=name) from None
        except RecursionError:
            raise refusal("constraint", "the JSON schema is nested too deeply", param=name) from None
        return self

    @property
    def compiled(self):
        return self._compiled


class Generation(Strict):
    """What a completion and a chat request share: limits, sampling, stops, streaming and
    a constraint. The body is flat, as the API has it: its sampling and constraint fields
    are read into their groups from the whole body (an error still names the field by its
    place in the body)."""

    max_tokens: Optional[TokenCount] = None
    max_completion_tokens: Optional[TokenCount] = None
    sampling: SamplingFields = Field(default_factory=SamplingFields)
    stop: Optional[Stop] = None
    n: Optional[int] = None
    stream: flag(False) = False
    stream_options: Optional[StreamOptions] = None
    cache_prompt: flag(True) = True
    ignore_eos: flag(False) = False  # llama-server's: the end-of-generation tokens do not stop the reply
    verbose: flag(False) = False  # llama-server's: the reply carries `__verbose`, the native result
    return_progress: flag(False) = False  # llama-server's: a stream tells the prompt's progress (prompt_progress)
    timings_per_token: flag(False) = False  # llama-server's: each streamed chunk carries the timings so far
    # (token id or text, bias) pairs (_logit_bias); the server checks the ids against the vocabulary
    logit_bias: Annotated[Optional[Any], BeforeValidator(_logit_bias)] = None
    constraint: ConstraintFields = Field(default_factory=ConstraintFields)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        for name, asked in UNSUPPORTED.items():
            if isinstance(body, dict) and asked(body.get(name)):
                raise refusal("unsupported", "'{param}' is not supported by this server{why}", param=name,
                              why=WHY.get(name, ""))
        return body

    @model_validator(mode="before")
    @classmethod
    def _gather_groups(cls, body: Any) -> Any:
        """Each group reads its fields from the body itself (a key of the group's name in
        the body is not the API's, and is passed over)."""
        if isinstance(body, dict):
            return {**body, "sampling": body, "constraint": body}
        return body

    @field_validator("n")
    @classmethod
    def _choices(cls, n: Optional[int]) -> Optional[int]:
        if n is not None and not 1 <= n <= MAX_CHOICES:
            raise refusal("n", "must be between 1 and {most} (choices of one request)", most=MAX_CHOICES)
        return n

    @model_validator(mode="after")
    def _choices_whole(self):
        if (self.n or 1) > 1 and self.stream:
            raise refusal("n", "n > 1 is answered whole: a streamed reply has one choice", param="n")
        return self

    @property
    def stops(self) -> List[str]:
        """The stop strings asked for (empty ones are no stop)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def probs_asked(self) -> Optional[int]:
        """The alternatives each emitted token lists with its log-probability (0: the
        token's own alone), or None: no log-probabilities asked."""
        return None

    @property
    def post_sampling(self) -> bool:
        """Whether those are probabilities after the sampler instead (llama-server's
        native post_sampling_probs)."""
        return False


# -- completions ------------------------------------------------------------------------------------

def _one_prompt(prompt: Any) -> Any:
    """A batch of one is its prompt; bigger batches are refused (n=1)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise refusal("batch", "must be one prompt, a string or a list of token ids (n=1: no batches)")
        return prompt[0]
    return prompt


class CompletionRequest(Generation):
    prompt: Annotated[Union[Annotated[str, Field(min_length=1)], Annotated[List[int], Field(min_length=1)]],
                      BeforeValidator(_one_prompt)]
    logprobs: Optional[Probs] = None  # as llama-server reads it: n_probs (0: none)

    @property
    def probs_asked(self) -> Optional[int]:
        return self.logprobs or None


# -- chat ------------------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["text"]
    text: str


class UnreadablePart(Strict):
    """The API's other content parts: known, and refused by name."""

    type: Literal["image_url", "input_audio", "file", "refusal"]

    @model_validator(mode="after")
    def _text_only(self):
        raise refusal("text_only", "is {what} content: this model reads text only", what=repr(self.type))


ContentPart = Annotated[Union[TextPart, UnreadablePart], Field(discriminator="type")]


def _arguments(value: Any) -> Any:
    """A call's arguments: the API sends them as JSON text, templates write them out key by key."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            raise refusal("json", "is not valid JSON") from None
    if not isinstance(value, dict):
        raise refusal("json_object", "must be a JSON object")
    return value


class CallFunction(Strict):
    name: Annotated[str, Field(min_length=1)]
    arguments: Annotated[dict, BeforeValidator(_arguments)]


class ToolCall(Strict):
    id: Optional[str] = None
    function: CallFunction


class ChatMessage(Strict):
    role: Literal[ROLES]
    content: Union[str, List[ContentPart], None] = None
    tool_calls: Optional[List[ToolCall]] = None
    reasoning_content: Optional[str] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    @property
    def text(self) -> str:
        """The content as text: its parts a line apart, as llama.cpp hands them to a template."""
        return self.joined("\n")

    def joined(self, between: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return between.join(part.text for part in self.content)


class FunctionSpec(Strict):
    name: ToolName
    description: str = ""
    parameters: dict = Field(default_factory=dict)
    strict: Optional[bool] = None  # its calls' arguments are held to its parameters (tool_grammar)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Generation):
    messages: List[ChatMessage]  # empty: the template over no messages, as llama-server renders it
    tools: Optional[Annotated[List[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = None  # null: auto
    parallel_tool_calls: flag(True) = True
    chat_template_kwargs: Optional[dict] = None  # over the server's --chat-template-kwargs, one by one
    reasoning_effort: Optional[ReasoningEffort] = None  # wins over chat_template_kwargs', as in llama-server
    reasoning_format: Optional[Literal[REASONING_FORMATS]] = None
    logprobs: flag(False) = False
    top_logprobs: Optional[Probs] = None  # with logprobs; left out: 20, as llama-server
    # transformers' and vLLM's words for what a final assistant message gets here anyway (it
    # is continued, as llama-server's prefill): continue_final_message asks for it, and
    # add_generation_prompt true beside it contradicts it (llama-server's 400)
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    renders_alone: ClassVar[bool] = False  # add_generation_prompt false: the messages rendered alone (/apply-template)

    @model_validator(mode="after")
    def _continuation(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise refusal("continue_final_message", "Cannot set both add_generation_prompt and continue_final_message "
                          "to true.", param="continue_final_message")
        assistant_last = bool(self.messages) and self.messages[-1].role == "assistant"
        if self.continue_final_message and not assistant_last:
            raise refusal("continue_final_message", "continue_final_message needs the last message to be the "
                          "assistant's, to continue", param="continue_final_message")
        if self.add_generation_prompt is False and not assistant_last and not self.renders_alone:
            raise refusal("add_generation_prompt", "add_generation_prompt false is taken only where the last message "
                          "is the assistant's (it is continued)", param="add_generation_prompt")
        return self

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise refusal("top_logprobs", "top_logprobs requires logprobs to be set to true", param="top_logprobs")
        return self

    @property
    def probs_asked(self) -> Optional[int]:
        if not self.logprobs:
            return None
        return DEFAULT_TOP_LOGPROBS if self.top_logprobs is None else self.top_logprobs

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_effort(cls, kwargs: Optional[dict]) -> Optional[dict]:
        if kwargs and "reasoning_effort" in kwargs and kwargs["reasoning_effort"] not in REASONING_EFFORTS:
            raise refusal("reasoning_effort", "has a reasoning_effort of {got}, not one of 'low', 'medium' or 'high'",
                          got=json.dumps(kwargs["reasoning_effort"]))
        return kwargs

    @model_validator(mode="after")
    def _tools_and_choice(self):
        names = set()
        for i, tool in enumerate(self.tools or []):
            if tool.function.name in names:
                raise refusal("tools", "tools[{i}]: the name {name} is given twice", param="tools", i=i,
                              name=repr(tool.function.name))
            names.add(tool.function.name)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise refusal("tool_choice", "'tool_choice' names {name}, which is not among the tools",
                          param="tool_choice", name=repr(choice.function.name))
        if choice == "required" and not names:
            raise refusal("tool_choice", "'tool_choice' is 'required' but no tools are given", param="tool_choice")
        return self


# -- llama-server's tokenizer endpoints ---------------------------------------------------------

class TokenizeRequest(Strict):
    content: str
    add_special: flag(False) = False
    parse_special: flag(True) = True
    with_pieces: flag(False) = False


class DetokenizeRequest(Strict):
    tokens: List[int]
