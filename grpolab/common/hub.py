"""Models and data sets by their Hugging Face Hub id (``org/name``), through ``huggingface_hub``.

A spec is a Hub id when it has the shape ``org/name``, names no local file or directory (a local path always wins)
and has no data-file suffix (``x/train.jsonl`` that does not exist is a missing file, not a repository).
:func:`snapshot` gives the repository's files on local disk: downloaded when the Hub can be reached, read from the
Hugging Face cache (``$HF_HOME/hub``, ``$HF_HUB_CACHE``) when the machine is offline (``HF_HUB_OFFLINE=1``) or the
files are there already. ``snapshot_download`` does both; what it raises becomes one line that says what to do
(:class:`HubError`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".gguf", ".py", ".toml")
"""Suffixes that make a missing ``a/b.suffix`` a missing local file rather than a Hub id."""
MODEL_FILES_SKIPPED = [
    "*.gguf",
    "*.onnx",
    "onnx/*",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "openvino/*",
    "original/*",
]
"""Weights in formats transformers does not load for training (a repository often holds several)."""


class HubError(FileNotFoundError):
    """A Hub id that cannot be resolved: the message says why, and what to do, in one line."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A repository's files on local disk, and exactly which version they are."""

    repo_id: str
    repo_type: str
    """``model`` or ``dataset``."""
    revision: str
    """What was asked for: a branch, a tag or a commit (``main`` when none)."""
    commit: str
    """The commit the files are from."""
    path: Path

    def record(self) -> dict:
        """What a run's config.json records of it."""
        return {"id": self.repo_id, "revision": self.revision, "commit": self.commit}


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` names a Hub repository rather than a local path (module docstring)."""
    spec = str(spec)
    if not REPO_ID.match(spec) or spec.lower().endswith(FILE_SUFFIXES) or ".." in spec:
        return False
    return not Path(spec).expanduser().exists()


def snapshot(
    repo_id: str,
    repo_type: str = "model",
    revision: str = "",
    *,
    flag: str = "--model",
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
) -> Snapshot:
    """The files of ``repo_id`` at ``revision`` (default ``main``) on local disk; :class:`HubError` naming ``flag``
    when there are none to be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    where = f"{flag} {repo_id}" + (f" (revision {revision})" if revision else "")
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        path = snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision or None,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
        )
    except hf.GatedRepoError:
        raise HubError(
            f"{where}: a gated repository; accept its conditions on huggingface.co/{_url_part(repo_id, repo_type)} "
            f"and {login}"
        ) from None
    except hf.RepositoryNotFoundError:
        raise HubError(
            f"{where}: no such {repo_type} repository on the Hugging Face Hub (or a private one: {login}); "
            "a local path must exist"
        ) from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{where}: the repository has no revision {revision!r} (a branch, tag or commit)") from None
    except hf.LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise HubError(
            f"{where}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; download it first on a "
            f"machine that is online (`hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}"
            f"{' --revision ' + revision if revision else ''}`) into this cache, or give a local path"
        ) from None
    except hf.HFValidationError as e:
        raise HubError(f"{where}: not a valid Hub id ({str(e).splitlines()[0]})") from None
    except (OSError, hf.HfHubHTTPError) as e:  # a network failure mid-download, a disk full: one line, the cause
        if getattr(getattr(e, "response", None), "status_code", None) in (401, 403):
            raise HubError(f"{where}: the Hub refused access (a private or gated repository: {login})") from None
        raise HubError(f"{where}: could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    path = Path(path)
    return Snapshot(repo_id, repo_type, revision or "main", path.name, path)


def _url_part(repo_id: str, repo_type: str) -> str:
    return f"datasets/{repo_id}" if repo_type == "dataset" else repo_id


def missing_file(snap: Snapshot, file: str, flag: str = "--gguf-file") -> HubError:
    """The error of a file the repository's snapshot lacks: not cached (offline), or not in the repository."""
    from huggingface_hub import constants

    where = f"--model {snap.repo_id} {flag} {file}"
    if constants.HF_HUB_OFFLINE:
        return HubError(
            f"{where}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; download "
            f"it first on a machine that is online (`hf download {snap.repo_id} {file}`) into this cache"
        )
    return HubError(f"{where}: the repository has no such file at commit {snap.commit}")
