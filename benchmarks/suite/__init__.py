"""The side-by-side benchmark suite behind ``benchmarks/run.py`` (see benchmarks/README.md).

Modules, one concern each:

* :mod:`configs`: the workload (model, data, batch) and the list of configurations per suite;
* :mod:`systems`: the training loops: ampzero and Lightning's ddp through ``Trainer.fit``, and
  bare loops for raw FSDP2 (``apply_zero``), DDP and DeepSpeed;
* :mod:`meter`: what is measured inside a run (step times, losses, RSS, model states);
* :mod:`comm`: bytes and elements communicated, counted at the c10d layer from a profiler trace;
* :mod:`deepspeed_state`: DeepSpeed's model-state bytes, read from its tensors;
* :mod:`worker`: the per-process entry point (``torchrun``), one repetition of every configuration;
* :mod:`report`: aggregation over repetitions, ratios, targets, JSON, markdown and plots;
* :mod:`gpu`: the single-GPU suite (not run on the CPU machine).
"""
