"""A checkpoint named by its Hugging Face hub id, `ORG/NAME[@REVISION]`, resolved to a
local directory through huggingface_hub: its cache (`HF_HOME`, `HF_HUB_CACHE`), its
offline mode (`HF_HUB_OFFLINE=1`) and its token (`HF_TOKEN` or a saved login). Only the
files a family's reader needs are downloaded: the config, the tokenizer and chat template,
the weights (the shards an index names, else `model.safetensors`, else
`pytorch_model.bin`) and the draft-only adapter's folder. The directory is then read as
any local checkpoint is (loading.py), with the same checks.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

# An id as the hub spells one (a local path that exists wins over it: loading.resolve).
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
META = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
        "model.safetensors.index.json", "pytorch_model.bin.index.json", "linear_spec_lora/*"]
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE = ("model.safetensors", "pytorch_model.bin")
_INDEX_MAX = 64 << 20   # an index names shards; one of this size is no index


class HubError(FileNotFoundError):
    """A hub checkpoint that cannot be had: its message says what is missing and how to
    fetch it."""


def is_hub_name(name) -> bool:
    """Whether `name` reads as a hub id and not as a local path: ORG/NAME[@REVISION]
    where no ORG directory exists here (a typo in out/model is a missing directory,
    never a download)."""
    return (isinstance(name, str) and HUB_NAME.match(name) is not None
            and not Path(name.split("/")[0]).is_dir())


def resolve(name: str, revision: str | None = None, weights: bool = True) -> Path:
    """The local snapshot directory of hub checkpoint `name` (`ORG/NAME[@REVISION]`; a
    `revision` given here wins over one in the name), downloading what it lacks unless
    the hub is offline (`weights` False: the config, tokenizer and adapter only)."""
    repo, rev = HUB_NAME.match(name).group("repo", "rev")
    revision = revision or rev
    if importlib.util.find_spec("huggingface_hub") is None:
        raise HubError(f"{name} names a Hugging Face hub checkpoint, which needs the "
                       "huggingface_hub package: pip install huggingface_hub")
    folder = _snapshot(name, repo, revision, META)
    if not weights:
        return folder
    for files in _weights(folder):
        folder = _snapshot(name, repo, revision, files)
        if all((folder / f).is_file() for f in files):
            break
    _check_complete(name, repo, revision, folder)
    return folder


def _snapshot(name: str, repo: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        # Offline, a snapshot whose cached listing names files it lacks (optional ones
        # among them): what a reader needs is checked by `_check_complete`.
        if getattr(e, "snapshot_path", None):
            return Path(e.snapshot_path)
        raise HubError(f"{name}: not in the hub cache ({constants.HF_HUB_CACHE})"
                       + _fetch_hint(repo, revision)) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{name}: {first}" + ("" if Path(name).exists() else
                                             f" (and there is no local directory {name})")
                       ) from None


def _weights(folder: Path) -> list[list[str]]:
    """The weight files to fetch, in the order to try: every shard an index names, else
    the single-file layouts one after the other (the first found is used)."""
    for index in INDEXES:
        path = folder / index
        if path.is_file():
            return [_shards(path)]
    return [[single] for single in SINGLE]


def _shards(index: Path) -> list[str]:
    if index.stat().st_size > _INDEX_MAX:
        raise HubError(f"{index}: {index.stat().st_size} bytes, too large for an index")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{index}: not a weight index ({e})") from None
    bad = [s for s in shards if not isinstance(s, str) or "/" in s or s.startswith(".")]
    if bad or not shards:
        raise HubError(f"{index}: not a weight index (shard names {bad[:3] or 'none'})")
    return shards


def _check_complete(name: str, repo: str, revision: str | None, folder: Path) -> None:
    """What a reader needs is in `folder`, else one line naming it and how to fetch it
    (offline, or a repository that lacks it)."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    for index in INDEXES:
        if (folder / index).is_file():
            missing += [s for s in _shards(folder / index) if not (folder / s).is_file()]
            break
    else:
        if not any((folder / s).is_file() for s in SINGLE):
            missing.append(" or ".join(SINGLE))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                          else "")
        raise HubError(f"{name}: {shown} missing from {folder}" + _fetch_hint(repo, revision))


def _fetch_hint(repo: str, revision: str | None) -> str:
    from huggingface_hub import constants

    command = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    if constants.HF_HUB_OFFLINE:
        return f"; HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it with `{command}`"
    return f"; fetch it with `{command}`"
