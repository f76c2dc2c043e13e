"""dflash-bench: a target/drafter pair measured in every decoding mode (plain, chain,
DDTree budgets, auto), greedy and sampled, beside llama.cpp's own tools on the same GGUF
(llama-bench, llama-completion, llama-speculative-simple's DFlash), every repetition kept
with the provenance a number needs (see cli.py).

  prompts.py    the built-in prompts
  runs.py       one run and the sampling settings
  ours.py       our modes through Engine
  llama_cpp.py  llama.cpp's tools: command lines and their logs
  stats.py      medians and spread
  report.py     rows, ratios, tables
  provenance.py commit, machine, versions, load
  workload.py   multi-turn workload files, and sessions from logged requests
  multiturn.py  dflash-bench workload: the sessions through dflash-server, per arm, checked
"""
