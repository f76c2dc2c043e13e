"""The tests of llama.cpp's server suite that dflash-server is not expected to pass, by
test id (a prefix: every parametrization of a test), each with its reason:

- MODEL: it checks the words of the suite's own model (tinyllama / stories260K, a llama
  dflash-gguf does not load; the launcher serves the bundled demo target instead), or a
  property of that model's vocabulary (a BOS token, fill-in-the-middle tokens);
- FEATURE: a llama-server feature dflash-server does not have (yet), named;
- BY DESIGN: dflash-server differs on purpose (the CORS default, synthetic drafts);
- DIFFERENCE: a difference from llama-server still to settle, said how.

Every other test of a file the CI runs must pass (tests/serving/test_llama_server_suite.py)."""
from __future__ import annotations

from typing import Optional

MODEL = "the suite's model's own words or vocabulary"
SYNTHETIC = ("BY DESIGN: --spec-synth-rates, llama.cpp's synthetic drafts, accepted at random whatever the "
             "target says (for benchmarking; its own warning: 'generated output is not valid'): a lossless "
             "engine does not offer them")
EXPECTED = {
    # -- test_basic ---------------------------------------------------------------------------
    "unit/test_basic.py::test_load_split_model": MODEL + ": 'little|girl' from a split stories15M",
    # -- test_chat_completion ---------------------------------------------------------------------------
    "unit/test_chat_completion.py::test_chat_completion[": MODEL + ": its replies and prompt token counts",
    "unit/test_chat_completion.py::test_chat_completion_cached_tokens": MODEL + ": its prompt token counts",
    "unit/test_chat_completion.py::test_chat_completion_stream[": MODEL + ": its replies and token counts",
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library": MODEL + ": 'Suddenly'",
    "unit/test_chat_completion.py::test_chat_template": MODEL + ": the prompt begins with tinyllama's BOS ('<s> ')",
    "unit/test_chat_completion.py::test_return_progress[64-4-False]": MODEL + ": its prompt's token count (the "
                                                                      "reports come one per 64-token batch: 4 for "
                                                                      "tinyllama's tokens, 1 for the demo target's 50)",
    # -- test_completion ------------------------------------------------------------------------------
    "unit/test_completion.py::test_completion[": MODEL + ": its words and prompt token counts",
    "unit/test_completion.py::test_completion_stream[": MODEL + ": its words and prompt token counts; also "
                                                                "llama.cpp's adaptive-p sampler settings",
    "unit/test_completion.py::test_completion_with_openai_library": MODEL + ": 'going|bed'",
    "unit/test_completion.py::test_completion_stream_with_openai_library": MODEL + ": 'going|bed', Phi-3.5's joke",
    "unit/test_completion.py::test_completion_response_fields[I believe the meaning of life is-32-":
        MODEL + ": its BOS in the prompt ('<s> ')",
    "unit/test_completion.py::test_completion_prompt_cache": MODEL + ": its prompt token counts",
    # -- test_tokenize ------------------------------------------------------------------------
    "unit/test_tokenize.py::test_tokenize_with_bos": MODEL + ": the demo target's tokenizer adds no BOS",
    # -- test_security ------------------------------------------------------------------------
    "unit/test_security.py::test_access_static_assets_without_api_key": "FEATURE: the web UI's assets (another issue)",
    "unit/test_security.py::test_cors_options[localhost-": "BY DESIGN: an Origin of 'localhost' (no scheme) is no "
                                                           "localhost origin under the default --cors-origins localhost",
    "unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Origin":
        "BY DESIGN: llama-server's default lets any origin read replies; dflash-server's lets localhost pages only",
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": "FEATURE: --tools "
                                                                                          "(built-in tools)",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": "FEATURE: --ui-mcp-proxy",
    "unit/test_security.py::test_local_media_file[../../../tools-": "FEATURE: images (--media-path, tinygemma3)",
    # -- test_metrics ---------------------------------------------------------------------------
    "unit/test_metrics.py::test_metrics_embedding_prompt_is_counted": "FEATURE: embeddings",
    # -- test_infill ------------------------------------------------------------------------------
    "unit/test_infill.py::": MODEL + ": the demo target has no fill-in-the-middle tokens, so /infill answers "
                                     "llama-server's 501 (infill not supported by this model)",
    # -- test_ctx_shift ---------------------------------------------------------------------------
    "unit/test_ctx_shift.py::test_ctx_shift_enabled": "FEATURE: --context-shift",
    "unit/test_ctx_shift.py::test_ctx_shift_disabled_long_prompt": MODEL + ": its long prompt is 208 tokens in the "
                                                                           "demo target's vocabulary, which fit a "
                                                                           "slot's 256",
    "unit/test_ctx_shift.py::test_ctx_shift_disabled_short_prompt[-1-": MODEL + ": its tokenizer's prompt length "
                                                                              "(8 tokens) sets the tokens generated",
    # -- test_template ------------------------------------------------------------------------------
    # -- test_speculative ---------------------------------------------------------------------------
    "unit/test_speculative.py::test_with_and_without_draft": SYNTHETIC + ", in the test's last part",
    "unit/test_speculative.py::test_synth_": SYNTHETIC,
    "unit/test_speculative.py::test_slot_ctx_not_exceeded": MODEL + ": 'Hello ' x 248 is 745 tokens in the demo "
                                                                    "target's vocabulary, past the 256 of a slot",
    "unit/test_speculative.py::test_with_ctx_shift": "FEATURE: --context-shift",
    "unit/test_speculative.py::test_multi_requests_parallel": MODEL + ": 'wise|kind|owl|answer'",
    # -- test_compat_anthropic ------------------------------------------------------------------------
    "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image": "BY DESIGN: an image for a text model is "
                                                                            "the request's fault, a 400 (llama-server "
                                                                            "answers 500)",
    "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted": "BY DESIGN: as above, 400 not 500",
    "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model": "FEATURE: images",
    "unit/test_compat_anthropic.py::test_anthropic_thinking_with_reasoning_model": MODEL + ": DeepSeek-R1-Distill's "
                                                                                   "thinking",
    # -- test_stream ----------------------------------------------------------------------------------
    "unit/test_stream.py::": "FEATURE: the router and its resumable streams (/v1/stream)",
    # -- test_compat_oai_responses (every check before the model's words passes) -----------------------
    "unit/test_compat_oai_responses.py::test_responses_with_openai_library": MODEL + ": 'Suddenly'",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_openai_library": MODEL + ": 'Suddenly'",
}


def reason(test_id: str) -> Optional[str]:
    """Why `test_id` is expected to fail, or None: it must pass."""
    for prefix, why in EXPECTED.items():
        if test_id.startswith(prefix):
            return why
    return None
