// dflash-draft-eval: llama.cpp's drafter, tensor by tensor, for python -m dflash_gguf.tools.parity_draft.
//
// llama-eval-callback prints a target's named tensors; no llama.cpp tool prints a drafter's.
// This one sets up a target and its drafter as llama-speculative-simple does (same flags:
// -m, -md, --spec-type, --spec-draft-n-max, ...), gives the drafter's context alone
// common_debug_cb_eval, and runs what our engine runs before its first verify: the whole
// prompt through the target, the drafter fed that prompt, the target's greedy token, and one
// draft from it. Marker lines split the log into those two phases, so that the parity tool
// pairs each of our drafter's graphs with the phase that computes it. Built by
// scripts/llama_cpp_build.py against the same static libraries as llama.cpp's tools.
#include "arg.h"
#include "common.h"
#include "debug.h"
#include "log.h"
#include "llama.h"
#include "speculative.h"

#include <clocale>
#include <vector>

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");

    common_params params;
    common_init();
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_SPECULATIVE)) {
        return 1;
    }
    const auto limits = common_speculative_get_output_limits(params.n_batch, params.n_parallel,
                                                             common_speculative_n_max(&params.speculative));
    params.n_outputs_max         = limits.total;
    params.n_outputs_max_per_seq = limits.per_seq;
    params.warmup                = false;  // a warm-up would print the drafter's graphs once more

    llama_backend_init();
    llama_numa_init(params.numa);

    auto init_tgt = common_init_from_params(params);
    llama_model   * model_tgt = init_tgt->model();
    llama_context * ctx_tgt   = init_tgt->context();
    if (model_tgt == nullptr || ctx_tgt == nullptr) {
        LOG_ERR("%s: cannot load the target\n", __func__);
        return 1;
    }

    // the callback on the drafter's context only: the target's graphs stay silent
    common_debug_cb_user_data cb_data;
    common_params params_dft = common_base_params_to_speculative(params);
    params_dft.cb_eval           = common_debug_cb_eval;
    params_dft.cb_eval_user_data = &cb_data;
    auto spec_init = common_speculative_init_from_params(params_dft, model_tgt, ctx_tgt);
    params.speculative.draft.ctx_tgt = ctx_tgt;
    params.speculative.draft.ctx_dft = spec_init->context();

    std::vector<llama_token> prompt = common_tokenize(ctx_tgt, params.prompt, true, true);
    if (prompt.empty() || prompt.size() > llama_n_batch(ctx_tgt) || prompt.size() + 2 > llama_n_ctx(ctx_tgt)) {
        LOG_ERR("%s: the prompt has %zu tokens: it must fit the batch and the context\n", __func__, prompt.size());
        return 1;
    }
    LOG_INF("number of input tokens = %zu\n", prompt.size());
    for (llama_token t : prompt) {
        LOG_INF("  %d\n", t);
    }

    common_speculative * spec = common_speculative_init(params.speculative, 1);
    if (spec == nullptr) {
        LOG_ERR("%s: cannot set up the drafter\n", __func__);
        return 1;
    }

    // the whole prompt through the target (the last row's logits kept), then to the drafter
    const llama_seq_id seq_id = 0;
    common_batch batch(ctx_tgt);
    for (size_t i = 0; i < prompt.size(); ++i) {
        batch.add(prompt[i], (llama_pos) i, seq_id, i + 1 == prompt.size());
    }
    if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) != 0) {
        LOG_ERR("%s: the target's prompt pass failed\n", __func__);
        return 1;
    }
    LOG("dflash_draft_eval: phase prompt\n");
    if (!common_speculative_process(spec, batch)) {
        LOG_ERR("%s: the drafter's prompt pass failed\n", __func__);
        return 1;
    }

    // the target's greedy token, and one draft from it
    const float * logits = llama_get_logits_ith(ctx_tgt, -1);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt));
    llama_token first = 0;
    for (int t = 1; t < n_vocab; ++t) {
        if (logits[t] > logits[first]) {
            first = t;
        }
    }
    LOG("dflash_draft_eval: first token %d\n", first);
    llama_tokens history(prompt.begin(), prompt.end());
    common_speculative_begin(spec, seq_id, history);
    llama_tokens draft;
    common_speculative_get_draft_params(spec, seq_id) = {
        /* .drafting = */ true,
        /* .n_max    = */ common_speculative_n_max(&params.speculative),
        /* .pos0     = */ (llama_pos) prompt.size(),
        /* .id_last  = */ first,
        /* .prompt   = */ &history,
        /* .result   = */ &draft,
    };
    LOG("dflash_draft_eval: phase draft\n");
    common_speculative_draft(spec);
    LOG("dflash_draft_eval: drafted");
    for (llama_token t : draft) {
        LOG(" %d", t);
    }
    LOG("\n");

    common_speculative_free(spec);
    llama_backend_free();
    return 0;
}
