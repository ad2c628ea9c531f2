"""DeepSpeed's ``compile`` section -> ``CompileConfig``.

DeepSpeed has had two forms of it: ``{enabled/disable, backend, kwargs}`` (the engine compiles
its module, or ``engine.compile()`` is called by the script) and DeepCompile
(``{deepcompile: true, free_activation, offload_*, ...}``: DeepSpeed's own graph passes that
schedule ZeRO-3's communication inside the compiled graph). A model trained with this strategy
calls neither, so the section is read as the intent it expresses: compile the model. Here that
is ``torch.compile`` of each block, FSDP2 keeping the communication where eager mode has it
(lightning_ampzero/torch_compile.py); a conversion note says so. ``enabled: false`` or
``disable: true`` keep it off.
"""

from __future__ import annotations

from typing import Any, Mapping

COMPILE_KEYS = ("enabled", "disable", "backend", "kwargs", "deepcompile")
#: torch.compile keyword arguments that CompileConfig carries.
COMPILE_KWARGS = ("mode", "fullgraph", "dynamic")
#: DeepCompile's optimization passes: DeepSpeed's scheduling of its own ZeRO-3, nothing here.
DEEPCOMPILE_KEYS = ("free_activation", "free_activation_threshold", "offload_activation", "offload_opt_states",
                    "offload_parameters", "double_buffer", "symmetric_memory", "dump_graphs", "debug_log",
                    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                    "keep_int_input_tensors", "keep_all_input_tensors")


def convert_compile(conv: Any, data: Mapping[str, Any]) -> None:
    """The config's ``compile`` section -> ``compile.*`` (enabled, backend, mode, fullgraph, dynamic)."""
    if "compile" not in data:
        return
    section = conv.section(data["compile"], "compile")
    conv.check_keys(section, COMPILE_KEYS + DEEPCOMPILE_KEYS, "compile")
    for key in ("enabled", "disable", "deepcompile"):
        if key in section and not isinstance(section[key], bool):
            conv.errors.append(f"compile.{key} must be true or false, got {section[key]!r}.")
            return
    if section.get("enabled") is False or section.get("disable") is True:
        return
    conv.set("compile.enabled", True, "compile")
    if "backend" in section:
        conv.set("compile.backend", section["backend"], "compile.backend")
    kwargs = conv.section(section.get("kwargs"), "compile.kwargs")
    for key, value in kwargs.items():
        if key in COMPILE_KWARGS:
            conv.set(f"compile.{key}", value, f"compile.kwargs.{key}")
        else:
            conv.errors.append(f"compile.kwargs.{key} is not taken here: torch.compile options that the strategy"
                               f" passes are {', '.join(COMPILE_KWARGS)} (and backend).")
    passes = [key for key in DEEPCOMPILE_KEYS if key in section]
    if passes:
        conv.no_effect.append((f"compile.{'/'.join(passes)}",
                               "DeepCompile's passes schedule DeepSpeed's own ZeRO-3; FSDP2 schedules it here"))
    how = "DeepCompile" if section.get("deepcompile") else "the section"
    conv.notes.append((
        "compile",
        f"{how} is read as 'compile the model': torch.compile of each repeated block (transformer block) before"
        " sharding, the communication staying outside the compiled graphs; set compile.enabled=false (or"
        " disable: true) to keep it off",
    ))
