"""The DeepSpeed JSON config importer; its public module is :mod:`lightning_ampzero.deepspeed`.

One module per part of the config, each with its key tables and its ``convert_*`` functions:

* ``common``: the error and warning, ``"auto"``, reading the JSON file, the key-table vocabulary.
* ``convert``: the top-level keys, the converter the sections record into, ``convert_deepspeed_config``.
* ``zero``: ``zero_optimization``.
* ``precision``: ``fp16``, ``bf16``, ``torch_autocast``, ``amp``, ``communication_data_type``.
* ``optim``: ``optimizer`` / ``scheduler``, with the typed configs and torch objects they become.
* ``features``: offload, ``aio``, ``activation_checkpointing``, ``msamp``.
* ``result``: :class:`~lightning_ampzero.deepspeed.ImportedDeepSpeedConfig`, applied to a Trainer or
  written for Hydra.
"""
