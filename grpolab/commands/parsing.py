"""A command's options parsed into its typed config: tyro over the config's dataclass, with ``--config FILE.toml``
for defaults, ``2,4,8`` lists and repeated flags of tuple fields (:func:`parse_config`)."""

from __future__ import annotations

import re


def split_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """Remove ``--config FILE`` (or ``--config=FILE``) from args."""
    rest, path = [], None
    it = iter(args)
    for a in it:
        if a == "--config":
            path = next(it, None)
            if path is None:
                raise SystemExit("error: --config needs a file")
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    return path, rest


NUMBER_LIST = re.compile(r"^-?[0-9.eE+-]+(,-?[0-9.eE+-]+)+$")


def split_number_lists(args: list[str]) -> list[str]:
    """Accept ``--group-sizes 2,4,8`` as well as tyro's ``--group-sizes 2 4 8``."""
    out: list[str] = []
    for a in args:
        out.extend(a.split(",") if NUMBER_LIST.match(a) else [a])
    return out


def merge_repeated(args: list[str], cls) -> list[str]:
    """``--policy a --policy b`` -> ``--policy a b`` for tuple-valued fields (tyro takes one occurrence), and
    ``--sampling fixed,filter`` -> ``--sampling fixed filter`` (comma lists of words, as of numbers)."""
    from grpolab.config import fields

    flags = {
        "--" + name.replace("_", "-") for name, o in fields.options(cls).items() if isinstance(o.field.default, tuple)
    }
    values: dict[str, list[str]] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in flags:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            values.setdefault(a, []).extend(v for arg in args[i + 1 : j] for v in arg.split(",") if v)
            i = j
        else:
            rest.append(a)
            i += 1
    for flag, vals in values.items():
        rest += [flag, *vals]
    return rest


def parse_config(cls, args: list[str], prog: str, description: str, base_of=None):
    """``args`` parsed into a ``cls`` config: its defaults, then a ``--config`` TOML file's options, then the flags.
    ``base_of(config)``: for a config as parsed, the config whose values replace the defaults, or None (``train
    --resume``: the run's own; the flags are then parsed again over it)."""
    import tyro

    from grpolab.config import fields, options
    from grpolab.config.toml import read_toml

    path, rest = split_config_flag(args)
    rest = merge_repeated(split_number_lists(rest), cls)
    options.check_flags(cls, rest, prog.removeprefix("grpolab "))  # one line for a wrong flag, as the API's
    from_file = read_toml(path, cls) if path else {}
    description += "\n\n--config FILE.toml sets defaults (keys are option names); flags override them."

    # a section's options are flags of their own names: --group-size, not --groups.group-size; a config without
    # sections keeps tyro's names for what it nests (sft's --model.hidden-size)
    spec = tyro.conf.OmitArgPrefixes[cls] if fields.sections(cls) else cls

    def parse(base):
        default = fields.from_flat(cls, from_file, base=base)
        return tyro.cli(spec, default=default, args=rest, prog=prog, description=description)

    cfg = parse(None)
    base = base_of(cfg) if base_of is not None else None
    return cfg if base is None else parse(base)


def run_defaults(cls, model_field: str):
    from grpolab.eval.runs import run_defaults_for  # imported late: the CLI sets OpenMP's environment first

    return run_defaults_for(cls, model_field)


def saved_run_config(cfg):
    """The config of the run ``--resume`` continues (its own options are the defaults), else None."""
    if not cfg.run.resume:
        return None
    from grpolab.training.recipe import saved_config

    return saved_config(cfg.run.out)
