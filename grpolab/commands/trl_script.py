"""``grpolab trl grpo ARGS``, ``grpolab trl rloo ARGS`` and ``grpolab trl distillation ARGS``: TRL's own GRPO, RLOO
and on-policy distillation scripts, on grpolab.

``trl grpo --config recipe.yaml`` runs the installed trl's ``trl/scripts/grpo.py``; ``grpolab trl grpo --config
recipe.yaml`` runs that same file, read from the installed trl when the command starts, with its two imports of
``GRPOConfig`` and ``GRPOTrainer`` taken from :mod:`grpolab.trl` and nothing else changed: TRL's parser, its
``--config`` YAML recipes, its dataset loading, its reward registry and its steps after training. The script is
executed, not re-written here, so a recipe means what it means under ``trl grpo``. ``grpolab trl rloo`` does the
same with ``trl/scripts/rloo.py`` and ``RLOOConfig`` / ``RLOOTrainer``, ``grpolab trl distillation`` with
``trl/scripts/distillation.py`` and ``DistillationConfig`` / ``DistillationTrainer``.

This module imports nothing of grpolab.trl (the layer above commands): the script it runs does, as a user's script
does.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

SCRIPTS = {"grpo": "trl.scripts.grpo", "rloo": "trl.scripts.rloo", "distillation": "trl.scripts.distillation"}
"""The TRL scripts this command runs, by ``trl``'s command name."""

METHODS = {"grpo": ("GRPO", ()), "rloo": ("RLOO", ()), "distillation": ("Distillation", ("ScriptArguments",))}
"""Each script's method (its config's and trainer's prefix) and the other names its parser's import line takes
beside DatasetMixtureConfig and ModelConfig (trl 1.16)."""


def _their_imports(method: str, more: tuple[str, ...] = ()) -> dict[str, str]:
    """The two import lines of TRL's script for ``method`` (GRPO, RLOO, Distillation) that name its config and
    trainer (trl 1.16), ``more`` the other names of the parser's line, and what each becomes."""
    kept = sorted(["DatasetMixtureConfig", "ModelConfig", *more])  # TRL sorts its imports
    configs = ", ".join(sorted([*kept, f"{method}Config"]))
    return {
        f"    from trl import {method}Trainer, get_dataset, get_peft_config, get_quantization_config\n": (
            f"    from grpolab.trl import {method}Trainer\n"
            "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
        ),
        f"    from trl import {configs}, TrlParser\n": (
            f"    from grpolab.trl import {method}Config\n    from trl import {', '.join(kept)}, TrlParser\n"
        ),
    }


THEIR_IMPORTS = {name: _their_imports(*METHODS[name]) for name in SCRIPTS}
"""Each script's two import lines that name its config and trainer (trl 1.16), and what each becomes."""

USAGE = """usage: grpolab trl {grpo,rloo,distillation} [TRL's arguments of that script] [--config recipe.yaml]

Run TRL's own GRPO, RLOO or distillation script (the installed trl's trl/scripts/grpo.py, rloo.py or
distillation.py, what `trl grpo`, `trl rloo` and `trl distillation` run) with its config and trainer from
grpolab.trl: the same arguments and YAML recipes as `trl grpo` (`trl rloo`, `trl distillation`). `grpolab trl grpo
--help` lists them, each with what grpolab does with it.
"""


class ScriptError(RuntimeError):
    """The installed trl's script cannot be run this way (trl missing, or its imports not the ones expected)."""


def script_source(name: str = "grpo") -> tuple[str, Path]:
    """The installed trl's script ``name`` with its config and trainer imports taken from grpolab.trl, and the file
    it was read from."""
    import importlib

    try:
        module = importlib.import_module(SCRIPTS[name])
    except ImportError as e:
        raise ScriptError(f"grpolab trl {name} runs TRL's own script, which needs trl installed ({e})") from None
    path = Path(module.__file__)
    source = path.read_text()
    for theirs, ours in THEIR_IMPORTS[name].items():
        if source.count(theirs) != 1:
            import trl

            raise ScriptError(
                f"trl {trl.__version__}'s {path.name} does not import {theirs.strip()!r} once, as trl 1.16's does: "
                "its config and trainer cannot be swapped for grpolab.trl's"
            )
        source = source.replace(theirs, ours)
    return source, path


def ignored_recipe_keys(code, path: Path, argv: list[str]) -> list[str]:
    """The keys of the ``--config`` recipe in ``argv`` that no dataclass of the script's parser has: TRL's script
    parses with ``fail_with_unknown_args=False``, so ``trl grpo`` ignores them without a word."""
    recipe = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    recipe = recipe or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if recipe is None or not Path(recipe).is_file():
        return []
    import dataclasses

    import yaml

    module = types.ModuleType("grpolab_trl_script")  # its dataclasses look their module up in sys.modules
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)  # the script's definitions only: its main block runs under "__main__"
        known = {f.name for cls in module.make_parser().dataclass_types for f in dataclasses.fields(cls)}
    finally:
        del sys.modules[module.__name__]
    given = yaml.safe_load(Path(recipe).read_text()) or {}
    return [k for k in given if k not in known and k != "env"] if isinstance(given, dict) else []


def run_script(name: str, argv: list[str]) -> None:
    """Execute TRL's script ``name`` as ``__main__`` with ``argv``, as ``trl name argv`` runs it; a recipe key the
    script would ignore silently is said in one line first."""
    source, path = script_source(name)
    code = compile(source, str(path), "exec")  # tracebacks name TRL's file and its lines
    for key in ignored_recipe_keys(code, path, argv):
        print(f"grpolab trl {name}: {key!r} in the recipe is no argument of trl {name}; ignored, as trl {name} "
              "ignores it", file=sys.stderr)  # fmt: skip
    saved = sys.argv
    sys.argv = [f"grpolab trl {name}", *argv]
    try:
        exec(code, {"__name__": "__main__", "__file__": str(path), "__builtins__": __builtins__})
    finally:
        sys.argv = saved


def main(argv: list[str]) -> None:
    """``grpolab trl SCRIPT ARGS``."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SCRIPTS:
        print(f"error: grpolab trl runs {', '.join(SCRIPTS)}, not {name!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    try:
        run_script(name, rest)
    except (ScriptError, ValueError) as e:  # ValueError: grpolab.trl's one-line refusals, TRL's own config errors
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
