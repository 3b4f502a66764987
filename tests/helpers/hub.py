"""A Hugging Face Hub cache laid out offline, as huggingface_hub lays it out."""

from __future__ import annotations

from pathlib import Path

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def hub_repo(hub: Path, repo_id: str, repo_type: str, commit: str, files: dict, refs=("main",)) -> Path:
    """A repository in a Hugging Face cache at ``hub`` (``$HF_HOME/hub``), laid out as huggingface_hub lays it out:
    ``<type>s--<org>--<name>/refs/<ref>`` holding the commit (no newline) and ``snapshots/<commit>/<files>``.
    ``files`` maps a path in the repository to its text, bytes, or a local file (a Path: linked, not copied, as the
    cache links snapshots to blobs). Returns the snapshot directory."""
    folder = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = snap / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content.resolve())
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return snap


def offline_hub(home: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache under ``home`` used offline, in this process (huggingface_hub reads its settings
    once, at import: its constants are set here) and in the processes it starts (the environment). Returns the hub
    directory that :func:`hub_repo` fills."""
    from huggingface_hub import constants

    hub = home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return hub
