"""``SAGE_ATTN``: SageAttention 2's ``sageattn`` behind Omni's layout contract.

Omni's layout ``[batch, seq, heads, head_dim]`` is sageattn's ``tensor_layout="NHD"``, so nothing is
transposed; grouped-query attention is native (query heads divisible by kv heads). SageAttention quantizes
Q/K to INT8 (and P/V to FP8 on Ada/Hopper), so it matches TORCH_SDPA only approximately, and it takes no
mask: a masked call is refused, never silently unmasked. ``sageattn`` dispatches on the GPU architecture
(sm80, sm86, sm89, sm90; sm120 and sm121 from 2.2.0) and raises a bare ``ValueError`` at the first forward elsewhere,
so the architecture is checked first and reported with the reason. Ring attention gets the kernel's own
log-sum-exp (``return_lse=True``), never a full score matrix. This module imports without sageattention.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import re
from typing import Any, Callable

import torch

from omni_core.attention.backend import AttentionBackend, AttentionImpl
from omni_core.errors import ComponentUnavailableError, ConfigError

NAME = "SAGE_ATTN"
MIN_VERSION = (2, 0)
#: architectures ``sageattention.sageattn`` dispatches (its ``get_cuda_arch_versions`` branch), by version
ARCHS = ("sm80", "sm86", "sm89", "sm90")
#: sm121 (GB10): dispatched on SageAttention's main branch since 6a64eb3, after the v2.2.0 tag, with the version
#: string still "2.2.0" -- a build of the tag itself raises its own ValueError on sm121 at the first forward
ARCHS_FROM = {(2, 2): ("sm120", "sm121")}
INSTALL_HINT = ("PyPI carries only sageattention 1.0.x (Triton-only); build >= 2 from "
                "https://github.com/thu-ml/SageAttention (pip install . --no-build-isolation)")


def installed_version() -> str | None:
    """The installed sageattention distribution's version, read from metadata (nothing imported)."""
    try:
        return md.version("sageattention")
    except md.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def supported_archs(version: str | None) -> tuple[str, ...]:
    """The architectures the installed sageattention dispatches (an unknown version: the 2.0 list)."""
    have = _version_tuple(version) if version else MIN_VERSION
    return ARCHS + tuple(a for since, extra in ARCHS_FROM.items() if have >= since for a in extra)


def check_capability(capability: tuple[int, int], version: str | None = None) -> str | None:
    """Why the installed sageattention does not run on a GPU of this compute capability, or None."""
    version = version if version is not None else installed_version()
    arch = f"sm{capability[0]}{capability[1]}"
    archs = supported_archs(version)
    if arch in archs:
        return None
    since = [v for v, extra in ARCHS_FROM.items() if arch in extra]
    upgrade = f" (sageattention supports {arch} from {since[0][0]}.{since[0][1]}.0: upgrade it)" if since else ""
    return (f"sageattention {version or '(unknown version)'} dispatches only {', '.join(archs)}; this GPU is "
            f"{arch}{upgrade}. Use TORCH_SDPA")


def device_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability (initialises CUDA: called per device, never by ``is_available``)."""
    return tuple(torch.cuda.get_device_capability(device))


def initialised_capability() -> tuple[int, int] | None:
    """The current GPU's capability when this process already uses CUDA (a worker), else None."""
    if not torch.cuda.is_initialized():
        return None
    return device_capability(torch.device("cuda", torch.cuda.current_device()))


def _present() -> bool:
    try:
        return importlib.util.find_spec("sageattention") is not None
    except (ImportError, ValueError):
        return False


_imported: dict[str, Any] = {}


def _import_sageattn() -> Callable[..., Any] | str:
    """``sageattention.sageattn``, or why it cannot be imported (cached)."""
    if "sageattn" not in _imported:
        try:
            _imported["sageattn"] = importlib.import_module("sageattention").sageattn
        except Exception as exc:  # noqa: BLE001 - reported as the reason the kernel is unusable
            _imported["sageattn"] = f"import sageattention failed: {type(exc).__name__}: {exc}"
    return _imported["sageattn"]


def availability() -> tuple[bool, str]:
    if not _present():
        return False, f"sageattention is not installed; {NAME} needs sageattention >= 2. {INSTALL_HINT}"
    version = installed_version()
    if version is not None and _version_tuple(version) < MIN_VERSION:
        return False, f"sageattention {version} is installed but {NAME} needs >= 2. {INSTALL_HINT}"
    if not torch.version.cuda:
        return False, f"sageattention is installed but torch {torch.__version__} is built without CUDA"
    found = _import_sageattn()
    if not callable(found):
        return False, found
    capability = initialised_capability()
    why = check_capability(capability, version) if capability is not None else None
    return (False, why) if why else (True, "")


_kernel_cache: dict[str, Callable[..., Any]] = {}


def sageattn_for(device: torch.device) -> Callable[..., Any]:
    """``sageattn`` for ``device`` (cached), or ComponentUnavailableError saying why.

    The one place the adapter reaches the library: tests substitute a torch reference here.
    """
    key = str(device)
    if key not in _kernel_cache:
        _kernel_cache[key] = _find_sageattn(torch.device(device))
    return _kernel_cache[key]


def _find_sageattn(device: torch.device) -> Callable[..., Any]:
    if device.type != "cuda":
        raise ComponentUnavailableError(f"{NAME} runs on CUDA devices only, got device {device}")
    ok, why = availability()
    if not ok:
        raise ComponentUnavailableError(f"{NAME} cannot run: {why}")
    why = check_capability(device_capability(device))
    if why:
        raise ComponentUnavailableError(f"{NAME} cannot run on {device}: {why}")
    return _import_sageattn()


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class SageAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, softmax_scale: float, causal: bool = False,
                 num_kv_heads: int | None = None, **options: Any) -> None:
        if options:
            raise ConfigError(f"{NAME} takes no options, got {', '.join(sorted(options))}", field="attention_config")
        super().__init__(num_heads, head_size, softmax_scale, causal, num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{NAME} needs heads ({self.num_heads}) divisible by kv heads ({self.num_kv_heads})")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is not None:
            raise ComponentUnavailableError(
                f"{NAME} does not support attention masks (got one of shape {tuple(attn_mask.shape)}); "
                f"select TORCH_SDPA, or FLASH_ATTN for key-padding masks, for this layer")
        q, k, v = self._prepare(query, key, value)
        return _first(sageattn_for(q.device)(q, k, v, tensor_layout="NHD", is_causal=self.causal,
                                             sm_scale=self.softmax_scale))

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's own log-sum-exp ``[batch, heads, seq_q]`` (float32, natural log), for Ring attention:
        memory stays linear in the sequence, where the base class would build a float32 score matrix."""
        q, k, v = self._prepare(query, key, value)
        out, lse = sageattn_for(q.device)(q, k, v, tensor_layout="NHD", is_causal=self.causal,
                                          sm_scale=self.softmax_scale, return_lse=True)
        return out, lse.float()

    def _prepare(self, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(f"{NAME} needs query, key and value of one dtype, got {query.dtype}, {key.dtype}, "
                             f"{value.dtype}")
        if query.shape[2] % key.shape[2]:
            raise ValueError(f"{NAME} needs query heads ({query.shape[2]}) divisible by key/value heads "
                             f"({key.shape[2]})")
        if self.causal and query.shape[1] != key.shape[1]:
            raise ComponentUnavailableError(
                f"{NAME}: causal attention needs seq_q == seq_k (sageattn defines its causal mask only then), "
                f"got {query.shape[1]} and {key.shape[1]}. Use TORCH_SDPA for this layer")
        return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))


class SageAttentionBackend(AttentionBackend):
    name = NAME
    #: the head dims SageAttention's kernels are built for (others are padded to 64/128 inside, or refused)
    supported_head_sizes = (64, 96, 128)
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)
    supports_mask = False
    supports_causal = True

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return SageAttentionImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """sageattention >= 2 is installed and imports, and torch is a CUDA build; where this process already
        uses CUDA, also that sageattn dispatches the current GPU's architecture."""
        return availability()

    @classmethod
    def check_capability(cls, capability: tuple[int, int]) -> str | None:
        why = check_capability(tuple(capability))
        return f"{NAME} cannot run on this GPU: {why}" if why else None
