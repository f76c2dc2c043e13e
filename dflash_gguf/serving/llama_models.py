"""llama-server's native requests (/completion, /infill, /apply-template), as pydantic
models beside openai_models': the same generation fields (sampling, stops, a grammar,
cache_prompt), llama-server's names for them (n_predict), and its prompt forms: text,
token ids, the two mixed in one list, {"prompt_string": ...}, or a list of such prompts
(a batch, answered as a list)."""
from __future__ import annotations

from typing import Any, ClassVar, List, Optional, Union

from pydantic import Field, field_validator, model_validator

from .api_errors import refusal
from .openai_models import ChatRequest, Generation, Probs, Strict, flag

Part = Union[str, int]  # a prompt is a list of parts: text (tokenized in place) and token ids


def _mixed(value: Any) -> bool:
    """A list of token ids and texts with at least one id: one prompt."""
    return isinstance(value, list) and bool(value) and all(isinstance(p, (int, str)) and not isinstance(p, bool)
                                                            for p in value) \
        and any(isinstance(p, int) for p in value)


def prompt_parts(value: Any, where: str = "prompt") -> List[Part]:
    """One prompt as parts, or a refusal."""
    if isinstance(value, str):
        return [value]
    if _mixed(value):
        return list(value)
    if isinstance(value, dict):
        if "multimodal_data" in value and value["multimodal_data"]:
            raise refusal("multimodal", "'{where}' has multimodal_data: this model reads text only", where=where,
                          param="prompt")
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise refusal("prompt", "'{where}' needs 'prompt_string', a string", where=where, param="prompt")
        return [text]
    raise refusal("prompt", "'{where}' must be a string, a list of token ids and strings, an object with "
                            "'prompt_string', or a list of those", where=where, param="prompt")


class NativeGeneration(Generation):
    """llama-server's generation fields over the OpenAI ones: n_predict (-1: no limit)
    for max_tokens, id_slot, return_tokens, response_fields, and n_probs (its alias
    logprobs): the target's log-probabilities of each token and its n_probs most likely
    alternatives; with post_sampling_probs, the probabilities after the sampler's rules
    instead (logit bias, penalties, top-k, top-p, min-p, temperature)."""

    n_predict: Optional[int] = None
    n_probs: Optional[Probs] = None
    post_sampling_probs: flag(False) = False
    id_slot: Optional[int] = None
    return_tokens: flag(False) = False
    response_fields: Optional[List[str]] = None

    @model_validator(mode="before")
    @classmethod
    def _n_predict(cls, body: Any) -> Any:
        if isinstance(body, dict) and body.get("n_predict") is not None and body.get("max_tokens") is None:
            n = body["n_predict"]
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                return {**body, "max_tokens": n}
        return body

    @model_validator(mode="before")
    @classmethod
    def _logprobs_alias(cls, body: Any) -> Any:
        """llama-server reads "logprobs" as n_probs when n_probs is not given."""
        if isinstance(body, dict) and body.get("n_probs") is None and body.get("logprobs") is not None:
            return {**body, "n_probs": body["logprobs"]}
        return body

    @field_validator("n_predict")
    @classmethod
    def _n_predict_range(cls, n: Optional[int]) -> Optional[int]:
        if n is not None and n < -1:
            raise refusal("n_predict", "must be >= 0, or -1 for no limit")
        return n

    @property
    def probs_asked(self) -> Optional[int]:
        return self.n_probs or None

    @property
    def post_sampling(self) -> bool:
        return self.post_sampling_probs


class NativeCompletionRequest(NativeGeneration):
    prompt: Any
    _prompts: List[List[Part]] = []

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not _mixed(value):
            for i, p in enumerate(value):
                prompt_parts(p, f"prompt[{i}]")
        else:
            prompt_parts(value)
        return value

    @property
    def prompts(self) -> List[List[Part]]:
        """The prompts asked for (a batch when more than one), each as its parts."""
        value = self.prompt
        if isinstance(value, list) and value and not _mixed(value):
            return [prompt_parts(p) for p in value]
        return [prompt_parts(value)]


class ExtraChunk(Strict):
    """A piece of context for /infill: a file's text and name."""

    text: str = ""
    filename: str = ""


class InfillRequest(NativeGeneration):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: List[ExtraChunk] = Field(default_factory=list)
    prompt: Optional[str] = None  # text after the prefix (llama.vim's current line)


class ApplyTemplateRequest(ChatRequest):
    """/apply-template: a chat's messages rendered to the prompt, not run;
    add_generation_prompt false renders the messages alone (no assistant's turn opened)."""

    add_generation_prompt: flag(True) = True
    renders_alone: ClassVar[bool] = True
