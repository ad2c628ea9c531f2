"""Command-line tools: ``ampzero-train`` (:mod:`lightning_ampzero.train`) and ``ampzero-config``
(:mod:`lightning_ampzero.cli.config`)."""
