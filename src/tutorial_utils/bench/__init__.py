"""The measuring code: one benchmark per chapter, and what they share.

- :mod:`.workload` builds the training step the benchmarks time (chapter 2's ladder of
  optimisations, ``nn.DataParallel``, DDP in N processes);
- one module per chapter's benchmark: :mod:`.one_gpu` (2), :mod:`.model_parallel` (3),
  :mod:`.collectives` (3b), :mod:`.data_parallel` (4), :mod:`.experiment` (5, 5d, 5e: training
  runs), :mod:`.scaling` (5b), :mod:`.timeline` (5b's profiler trace), :mod:`.memory` (5c);
- :mod:`.mfu` counts a step's model FLOPs and sets a throughput against the GPU's dense bf16
  peak, from its datasheet (model FLOPs utilisation, beside every GPU throughput);
- :mod:`.report` presents (tables, figure titles, glue); :mod:`.records` keeps the
  measurements made on more GPUs than a reader may have, dated, under ``book/data``;
- :mod:`.workers`: the measuring programs the benchmarks start under torchrun.

Each benchmark measures side by side in one run and reports ratios against a baseline of the
same run; ``python -m tutorial_utils.bench.<name> --help`` lists its options.
"""
