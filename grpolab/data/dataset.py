"""Records from the files people keep data in: JSONL, JSON, CSV, Parquet, a ``datasets`` directory, a Hub data set.

``.json``, ``.csv``, ``.parquet`` and directories written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk`` are read through the ``datasets`` library. So is a directory that holds a data set's
files as the Hub keeps them (parquet, jsonl, json or csv files, a README whose YAML names configurations and splits):
a clone of a Hub data set, or the snapshot of a Hub id (``org/name``, :mod:`grpolab.common.hub`) downloaded or found
in the Hugging Face cache. Such a data set's configuration and split are chosen by :class:`Ref`. ``.jsonl`` is read a line
at a time with :func:`grpolab.data.jsonl.iter_json_objects`, so that a malformed line is named by
its line number and every value keeps its JSON type (Arrow would make one type of a column).

Each row becomes a record (:mod:`grpolab.data.records`) under a format:

- ``prompt``: the prompt column (``--prompt-column``, default ``prompt``) holds a string or a chat
  (a list of ``{"role", "content"}`` messages); every other column is kept for the reward functions;
- ``gsm8k`` and ``math``: presets that map ``question``/``answer`` (``#### n``) or
  ``problem``/``solution`` (``\\boxed{}``) to a prompt and a ``ground_truth``;
- ``rows``: every row as it is, for an environment's ``reset`` (``--env``) to read;
- ``auto``: ``prompt`` when the rows have the prompt column, else the preset whose fields they have (for an
  environment task, else ``rows``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from grpolab.common.given import NOTHING, Given
from grpolab.common.hub import is_hub_id, snapshot
from grpolab.config.task import TRAIN_DATA, Ref
from grpolab.data.images import checked_images
from grpolab.data.jsonl import DataError, gsm8k_record, iter_json_objects
from grpolab.data.math_format import math_record
from grpolab.data.records import identity_of, is_chat

FILE_FORMATS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}  # read by `datasets`; .jsonl by line
PRESET_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def read_rows(
    path: str | Path, split: str = "", given: Given = NOTHING, ref: Ref = TRAIN_DATA
) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of a data file, a directory or a Hub data set; ``where`` names the row
    (``file:line`` for JSONL, ``file: row N`` otherwise). ``split``: which split of a data set that has several. Rows
    given to the Python API in memory are found under their description in ``given``."""
    live = given.lookup(str(path), "--data/--eval-data")
    if live is not None:
        yield from ((f"{path}: row {i + 1}", row) for i, row in enumerate(live))
        return
    if is_hub_id(str(path)):
        rows = _repository_split(hub_snapshot(str(path), ref).path, split, ref, str(path)).to_list()
    elif Path(path).suffix == ".jsonl":
        yield from iter_json_objects(Path(path))
        return
    else:
        rows = _read_with_datasets(Path(path), split, ref)
    for i, row in enumerate(rows):
        yield f"{path}: row {i + 1}", row


def hub_snapshot(spec: str, ref: Ref = TRAIN_DATA):
    """The files of the Hub data set ``spec`` on local disk (:func:`grpolab.common.hub.snapshot`)."""
    return snapshot(spec, "dataset", ref.revision, flag=ref.flag)


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _read_with_datasets(path: Path, split: str, ref: Ref = TRAIN_DATA) -> list[dict]:
    datasets = _quiet_datasets()
    if path.is_dir():
        if any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):  # written by save_to_disk
            return _saved_split(path, split).to_list()
        return _repository_split(path, split, ref, str(path)).to_list()
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    kind = FILE_FORMATS.get(path.suffix)
    if kind is None:
        raise DataError(
            f"{path}: file format {path.suffix or '(no suffix)'!r} not recognised; use .jsonl, .json, .csv, .parquet "
            "or a directory written by datasets' save_to_disk"
        )
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train").to_list()
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file; say which, in one line
        cause = e.__cause__ or e
        message = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        raise DataError(f"{path}: could not be read as {kind.upper()} ({message})") from None


def _repository_split(path: Path, split: str, ref: Ref, name: str):
    """One split of the data set whose files are in the directory ``path`` (a Hub snapshot or a clone), read by
    ``datasets`` as the Hub reads it (the README's configurations, else the files' names); ``name`` in errors."""
    datasets = _quiet_datasets()
    where = f"{ref.flag} {name}"
    try:
        configs = datasets.get_dataset_config_names(str(path))
    except Exception as e:  # noqa: BLE001 - no data files, an unreadable README: one line, the cause
        raise DataError(f"{where}: {_no_data_files(e)}") from None
    config = ref.config or None
    if config and config not in configs:
        raise DataError(f"{where}: no configuration {config!r} (configurations: {', '.join(configs)}); pass "
                        f"{_config_flag(ref)} with one of them")  # fmt: skip
    try:
        splits = datasets.get_dataset_split_names(str(path), config)
    except ValueError:  # several configurations, none of them the default
        raise DataError(f"{where}: several configurations ({', '.join(configs)}); choose one with "
                        f"{_config_flag(ref)}") from None  # fmt: skip
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{where}: {_no_data_files(e)}") from None
    chosen = split or (splits[0] if len(splits) == 1 else ref.default_split)
    if chosen not in splits:
        flag = "--data-split" if ref.flag == "--data" else "--eval-split"
        what = f"no split {split!r}" if split else f"several splits and none is {chosen!r}"
        raise DataError(f"{where}: {what} (splits: {', '.join(splits)}); pass {flag} with one of them")
    try:
        return datasets.load_dataset(str(path), config, split=chosen)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{where}: {_no_data_files(e)}") from None


def _config_flag(ref: Ref) -> str:
    return "--data-config" if ref.flag == "--data" else "--eval-config"


def _no_data_files(e: Exception) -> str:
    """One line for what ``datasets`` raised reading a data set's files."""
    name = type(e).__name__
    if name in ("DataFilesNotFoundError", "EmptyDatasetError", "FileNotFoundError"):
        return "no loadable data files (parquet, jsonl, json or csv) in the data set"
    text = str(e).strip().splitlines()
    return f"could not be read ({name}: {text[-1] if text else ''})"


def _saved_split(path: Path, split: str):
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk") from None
    if isinstance(saved, datasets.DatasetDict):
        if not split and len(saved) == 1:
            split = next(iter(saved))
        if split not in saved:
            what = f"split {split!r} not found" if split else "a DatasetDict: choose a split"
            raise DataError(f"{path}: {what} (splits: {', '.join(saved)}); pass --data-split / --eval-split")
        return saved[split]
    if split:
        raise DataError(f"{path}: a single Dataset, which has no splits; drop --data-split / --eval-split {split}")
    return saved


def load_records(
    path: str | Path,
    fmt: str = "auto",
    split: str = "",
    prompt_column: str = "prompt",
    given: Given = NOTHING,
    ref: Ref = TRAIN_DATA,
) -> list[dict]:
    """Every row of ``path`` as a record under ``fmt`` (module docstring). A bad row is a DataError naming it."""
    rows = list(read_rows(path, split, given, ref))
    if not rows:
        raise DataError(f"{path}: no records")
    columns = list(dict.fromkeys(k for _, row in rows for k in row))
    if fmt == "auto":
        fmt = detect_format(path, columns, prompt_column)
    if fmt == "rows":
        return [dict(row) for _, row in rows]
    if fmt == "prompt":
        if prompt_column not in columns:
            raise DataError(
                f"{path}: no {prompt_column!r} column (columns: {', '.join(columns)}); "
                "name the prompt column with --prompt-column"
            )
        base = Path(path).parent if Path(path).exists() else None
        return [prompt_record(where, checked_images(row, where, base), prompt_column) for where, row in rows]
    to_record = gsm8k_record if fmt == "gsm8k" else math_record
    return [to_record(where, row) for where, row in rows]


def data_format(
    path: str | Path, split: str = "", prompt_column: str = "prompt", given: Given = NOTHING, ref: Ref = TRAIN_DATA
) -> str:
    """The format ``auto`` resolves to for the data at ``path`` (its first row's columns for JSONL, else the
    data set's columns)."""
    live = given.lookup(str(path), "--data/--eval-data")
    if live is not None:
        return detect_format(path, list(dict.fromkeys(k for row in live for k in row)), prompt_column)
    if is_hub_id(str(path)):
        return detect_format(path, list(dict.fromkeys(k for _, row in read_rows(path, split, ref=ref) for k in row)),
                             prompt_column)  # fmt: skip
    path = Path(path)
    if path.suffix == ".jsonl":
        first = next(iter_json_objects(path), None)
        columns = list(first[1]) if first else []
    else:
        columns = _columns(path, split, ref)
    if not columns:
        raise DataError(f"{path}: no records")
    return detect_format(path, columns, prompt_column)


def _columns(path: Path, split: str, ref: Ref) -> list[str]:
    return list(dict.fromkeys(k for row in _read_with_datasets(path, split, ref) for k in row))


def detect_format(path, columns: list[str], prompt_column: str) -> str:
    """``prompt`` when the prompt column is there, else the preset whose fields the rows have."""
    if prompt_column in columns:
        return "prompt"
    for fmt, fields in PRESET_FIELDS.items():
        if all(f in columns for f in fields):
            return fmt
    presets = "; ".join(f"{fmt}: {' and '.join(fields)}" for fmt, fields in PRESET_FIELDS.items())
    raise DataError(
        f"{path}: no {prompt_column!r} column (columns: {', '.join(columns)}); name the prompt column with "
        f"--prompt-column, or give the fields of a preset ({presets})"
    )


def prompt_record(where: str, row: dict, prompt_column: str = "prompt") -> dict:
    """A row as a prompt record: ``prompt`` (a string or a chat), then every other column as it is."""
    prompt = row[prompt_column]
    if isinstance(prompt, list):
        if not is_chat(prompt):
            raise DataError(
                f"{where}: {prompt_column!r} is a list but not a chat: each message must be "
                '{"role": str, "content": str} (and the list not empty)'
            )
        prompt = [{"role": m["role"], "content": _content(m["content"])} for m in prompt]  # Arrow adds absent keys
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: {prompt_column!r} must be a non-empty string or a chat, got {prompt!r}"[:300])
    return {"prompt": prompt, **{k: v for k, v in row.items() if k != prompt_column}}


def hold_out(records: list[dict], fraction: float, seed: int, fmt: str = "") -> tuple[list[dict], list[dict]]:
    """``(train, held_out)``: ``round(fraction * U)`` of the U distinct prompts, with every record of them, held out
    (``fmt`` ``rows``, an environment's records: distinct rows).

    Which prompts: the first in the order of a hash of ``(seed, prompt)``, so the split does not depend on the order
    of the rows, and a prompt that appears twice is on one side only: no training prompt is in the held-out set.
    """

    def rank(question: str) -> bytes:
        return hashlib.sha256(f"{seed}\n{question}".encode()).digest()

    key = [identity_of(r, fmt) for r in records]
    prompts = sorted(set(key), key=rank)
    held = set(prompts[: round(fraction * len(prompts))])
    return [r for r, k in zip(records, key) if k not in held], [r for r, k in zip(records, key) if k in held]


def _content(content):
    """A message's content as the data gave it, without the keys Arrow adds as None to typed parts."""
    return content if isinstance(content, str) else [{k: v for k, v in p.items() if v is not None} for p in content]
