"""Checkpoint files read without running code, verified before any engine state changes.

DeepSpeed reads its checkpoint files with ``torch.load(weights_only=False)``, which runs whatever a pickle asks for:
a planted file would run code on the server. The training engine therefore never lets DeepSpeed open a file.
:func:`verify_checkpoint` reads every file of a checkpoint directory once, before DeepSpeed is involved:

- the manifest written at save (:func:`write_manifest`: every file's size and SHA-256) must list exactly the files
  present, none a symbolic link, each with its recorded size and hash (a truncated, deleted or flipped file is
  refused);
- every ``.pt`` file must load with ``torch.load(weights_only=True)``, allowing besides tensors and containers only
  the few plain DeepSpeed classes its checkpoints hold (:data:`DEEPSPEED_CHECKPOINT_CLASSES`); anything else is
  refused with the name of the global it asked for;
- every floating-point tensor must be finite, and the model's tensors must have the shapes of the model being
  loaded into.

The verified objects are then handed to DeepSpeed through :class:`VerifiedFiles`, a stand-in for its checkpoint
engine whose ``load`` returns them (files of other ranks are read again from verified bytes). A checkpoint that
fails any check is refused before DeepSpeed touches the weights, the optimizer or the step counter.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from arctic_rl.errors import InvalidRequestError

__all__ = [
    "DEEPSPEED_CHECKPOINT_CLASSES",
    "MANIFEST_NAME",
    "VerifiedFiles",
    "checkpoint_classes",
    "safe_load_bytes",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST_NAME = "arctic_rl_manifest.json"
_MANIFEST_FORMAT = 1
_MANIFEST_MAX_BYTES = 16 * 1024 * 1024
_CHUNK = 4 * 1024 * 1024

DEEPSPEED_CHECKPOINT_CLASSES: tuple[str, ...] = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)
"""Plain data classes DeepSpeed puts in its ZeRO optimizer files (an enum, a dataclass, the loss scalers, whose state
is numbers); ``weights_only`` loading builds them from their saved fields and calls no other code."""


def checkpoint_classes() -> list[Any]:
    """The classes of :data:`DEEPSPEED_CHECKPOINT_CLASSES` (imported: the allow-list of ``torch.load``)."""
    import importlib

    classes = []
    for path in DEEPSPEED_CHECKPOINT_CLASSES:
        module_name, _, name = path.rpartition(".")
        classes.append(getattr(importlib.import_module(module_name), name))
    return classes


def safe_load_bytes(data: bytes, where: str) -> Any:
    """``torch.load`` of ``data`` with ``weights_only=True`` and the DeepSpeed allow-list; refuses anything else."""
    try:
        with torch.serialization.safe_globals(checkpoint_classes()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        reason = str(error).strip()
        marker = "Unsupported global:"
        if marker in reason:
            reason = reason[reason.index(marker) :].split(" was not")[0]
        else:
            reason = reason.splitlines()[0] if reason else type(error).__name__
        raise InvalidRequestError(
            "path",
            f"{where} does not load as plain tensors and containers (torch.load weights_only=True), so it is not "
            f"loaded: {reason}. arctic-rl loads only checkpoints that run no code when read.",
        ) from None


def _sha256_of_file(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _files_under(directory: str) -> Iterator[str]:
    """Relative paths of everything under ``directory`` except the manifest; links and special files are refused."""
    for root, folders, files in os.walk(directory, followlinks=False):
        for name in [*folders, *files]:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, directory)
            if os.path.islink(full):
                raise InvalidRequestError(
                    "path", f"{relative} in checkpoint {directory} is a symbolic link; checkpoints hold plain files."
                )
            if name in files and not os.path.isfile(full):
                raise InvalidRequestError("path", f"{relative} in checkpoint {directory} is not a regular file.")
            if name in files and relative != MANIFEST_NAME:
                yield relative


def write_manifest(directory: str) -> None:
    """Record every file under ``directory`` (size and SHA-256) in its manifest; written atomically, last."""
    entries = {}
    for relative in sorted(_files_under(directory)):
        digest, size = _sha256_of_file(os.path.join(directory, relative))
        entries[relative] = {"sha256": digest, "bytes": size}
    manifest = {"format": _MANIFEST_FORMAT, "files": entries}
    temporary = os.path.join(directory, f".{MANIFEST_NAME}.tmp")
    with open(temporary, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST_NAME))


def _read_manifest(directory: str) -> dict[str, dict[str, Any]]:
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path) or os.path.islink(path):
        raise InvalidRequestError(
            "path",
            f"checkpoint {directory} has no {MANIFEST_NAME} (the file sizes and checksums arctic-rl writes when it "
            "saves); only checkpoints saved by save_checkpoint() of this version are loaded.",
        )
    if os.path.getsize(path) > _MANIFEST_MAX_BYTES:
        raise InvalidRequestError("path", f"{path} is larger than {_MANIFEST_MAX_BYTES} bytes; not a manifest.")
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        files = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        for name, entry in files.items():
            if not (isinstance(entry["sha256"], str) and isinstance(entry["bytes"], int)):
                raise ValueError(f"entry {name!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidRequestError("path", f"{path} is not a valid arctic-rl checkpoint manifest ({error}).") from None
    return files


def _check_finite(value: Any, where: str, key: str = "") -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
            raise InvalidRequestError(
                "path", f"{where} holds non-finite values (NaN or inf) in {key or 'a tensor'}; it is not loaded."
            )
    elif isinstance(value, Mapping):
        for name, item in value.items():
            _check_finite(item, where, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_finite(item, where, f"{key}[{index}]")


def _check_module_shapes(state: Any, where: str, expected: Mapping[str, tuple[int, ...]]) -> None:
    """The model file's tensors against the model being loaded into: the same names and shapes. ZeRO-3 saves empty
    placeholders in ``module`` and the parameters' shapes in ``param_shapes``; ``expected`` then holds the
    parameters' full shapes (``ds_shape``), else the module's state-dict shapes."""
    if not isinstance(state, Mapping) or not isinstance(state.get("module"), Mapping):
        raise InvalidRequestError("path", f"{where} holds no 'module' state dict; it is not a model checkpoint.")
    saved: dict[str, tuple[int, ...]] = {}
    param_shapes = state.get("param_shapes")
    if isinstance(param_shapes, (list, tuple)) and any(
        isinstance(value, torch.Tensor) and value.numel() == 0 for value in state["module"].values()
    ):
        for group in param_shapes:
            saved.update({str(name): tuple(int(size) for size in shape) for name, shape in dict(group).items()})
    else:
        saved = {
            str(name): tuple(value.shape) for name, value in state["module"].items() if isinstance(value, torch.Tensor)
        }
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        raise InvalidRequestError(
            "path",
            f"{where} does not hold this model's parameters (missing {missing[:3]}, unexpected {extra[:3]}); it "
            "belongs to another model.",
        )
    for name, shape in expected.items():
        if saved[name] != tuple(shape):
            raise InvalidRequestError(
                "path",
                f"{where}: {name} has shape {list(saved[name])}, but the model's is {list(shape)}; it belongs to "
                "another model.",
            )


def _is_model_file(relative: str) -> bool:
    return relative.endswith("model_states.pt")


class VerifiedFiles:
    """The checkpoint engine DeepSpeed reads through while loading a verified checkpoint: ``load(path)`` returns
    the object :func:`verify_checkpoint` read from that file, and reads any other listed file again from bytes
    whose hash matches the manifest, with the same safe loader. Paths outside the checkpoint are refused."""

    def __init__(self, directory: str, manifest: Mapping[str, Mapping[str, Any]], kept: dict[str, Any]) -> None:
        self.directory = os.path.realpath(directory)
        self.manifest = manifest
        self.kept = kept
        self.name = "arctic_rl_verified_files"

    def load(self, path: str, map_location: Any = None) -> Any:
        full = os.path.realpath(path)
        relative = os.path.relpath(full, self.directory)
        if relative in self.kept:
            return self.kept.pop(relative)
        if relative.startswith("..") or relative not in self.manifest:
            raise InvalidRequestError(
                "path", f"DeepSpeed asked for {path}, which is not a file of the verified checkpoint {self.directory}."
            )
        return _read_verified(self.directory, relative, self.manifest[relative])


def _read_verified(directory: str, relative: str, entry: Mapping[str, Any]) -> Any:
    with open(os.path.join(directory, relative), "rb") as handle:
        data = handle.read(int(entry["bytes"]) + 1)
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise InvalidRequestError(
            "path",
            f"{relative} in checkpoint {directory} does not match its manifest (size {len(data)} bytes, recorded "
            f"{entry['bytes']}, or its SHA-256 differs): the file is truncated or corrupted; it is not loaded.",
        )
    return safe_load_bytes(data, f"{relative} in checkpoint {directory}")


def verify_checkpoint(
    directory: str, *, model_shapes: Mapping[str, tuple[int, ...]], keep: Any = None
) -> VerifiedFiles:
    """Verify a checkpoint directory (see the module docstring); raises ``InvalidRequestError`` with the reason.

    ``keep(relative_path)`` says which verified objects to hold for the load (this rank's files); the others are
    read, checked and dropped. Returns the :class:`VerifiedFiles` to hand DeepSpeed."""
    manifest = _read_manifest(directory)
    present = set(_files_under(directory))
    missing = sorted(set(manifest) - present)
    if missing:
        raise InvalidRequestError(
            "path", f"checkpoint {directory} lacks {missing[:3]} that its manifest lists: it is incomplete."
        )
    unlisted = sorted(present - set(manifest))
    if unlisted:
        raise InvalidRequestError(
            "path", f"checkpoint {directory} holds {unlisted[:3]} that its manifest does not list; it is not loaded."
        )
    for relative, entry in manifest.items():
        digest, size = _sha256_of_file(os.path.join(directory, relative))
        if size != entry["bytes"] or digest != entry["sha256"]:
            raise InvalidRequestError(
                "path",
                f"{relative} in checkpoint {directory} does not match its manifest (size {size} bytes, recorded "
                f"{entry['bytes']}, or its SHA-256 differs): the file is truncated or corrupted; it is not loaded.",
            )
    model_files = [relative for relative in manifest if _is_model_file(relative)]
    if not model_files:
        raise InvalidRequestError("path", f"checkpoint {directory} holds no *model_states.pt file.")
    kept: dict[str, Any] = {}
    for relative in sorted(manifest):
        if not relative.endswith(".pt"):
            continue
        state = _read_verified(directory, relative, manifest[relative])
        where = f"{relative} in checkpoint {directory}"
        _check_finite(state, where)
        if _is_model_file(relative):
            _check_module_shapes(state, where, model_shapes)
        if keep is None or keep(relative):
            kept[relative] = state
        del state
    return VerifiedFiles(directory, manifest, kept)
