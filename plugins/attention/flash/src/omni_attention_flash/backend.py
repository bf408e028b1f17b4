"""``FLASH_ATTN``: FlashAttention behind Omni's layout contract.

Omni's layout ``[batch, seq, heads, head_dim]`` is flash-attn's own, so nothing is transposed. The adapter
makes the last dimension contiguous, passes grouped-query attention through natively (flash maps query
head ``h`` to kv head ``h // (heads // kv_heads)``, as ``repeat_interleave`` does), and turns a boolean
key-padding mask into a varlen call (keys unpadded, ``cu_seqlens``). Any other mask is refused: flash has
no dense-mask input, and ignoring a mask would be silently wrong.

Kernel sources, best first for a device: FlashAttention-3 (``flash_attn_interface``) on Hopper, flash-attn 2
(``flash_attn``, CUDA sm80+ or ROCm) first elsewhere, aiter (ROCm, PyPI package ``amd-aiter``). Current FA3
(``hopper/flash_api.cpp``: ``is_sm8x = major >= 8``, "Ampere GPUs or newer") runs on sm8x too, so an FA3-only
install is used on an A100; FA3 builds from before that change refuse non-Hopper GPUs at the first forward.
``options={"fa_version": 2}`` (or ``3``) pins one. A source whose kernels are not built for the GPU's
architecture (older than sm80) is skipped with the reason rather than failing at its first forward. Every call passes the arguments the sources name alike by keyword
(their positional orders differ). This module imports without any of them; it needs torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from omni_core.attention import tensors
from omni_core.attention.backend import AttentionBackend, AttentionImpl
from omni_core.errors import ComponentUnavailableError, ConfigError

NAME = "FLASH_ATTN"

#: (label, import name, flash-attention major version, torch build it serves: "cuda", "rocm" or "any")
SOURCES: tuple[tuple[str, str, int, str], ...] = (
    ("FlashAttention-3", "flash_attn_interface", 3, "cuda"),
    ("FlashAttention-3", "flash_attn_3.flash_attn_interface", 3, "cuda"),
    ("flash-attn", "flash_attn", 2, "any"),
    ("aiter", "aiter", 2, "rocm"),
)
INSTALL_HINT = ("install flash-attn >= 2.6 (pip install 'omni-attention-flash[kernels]' --no-build-isolation), "
                "FlashAttention-3 (flash-attention/hopper, sm80+) or, on ROCm, aiter "
                "(pip install amd-aiter; the PyPI package named 'aiter' is unrelated)")


@dataclasses.dataclass(frozen=True)
class FlashKernels:
    """The two library functions the adapter calls. Only q, k, v go by position; everything else by keyword
    (``softmax_scale``, ``causal``, ``cu_seqlens_q/k``, ``max_seqlen_q/k``), the names every source shares:
    their positional orders differ (FA3 has no ``dropout_p``; vllm's fork puts ``max_seqlen_q`` before
    ``cu_seqlens_q``), so nothing else is passed.
    """

    label: str
    #: ``flash_attn_func(q, k, v, *, softmax_scale, causal)``, q ``[batch, seq_q, heads, dim]``
    func: Callable[..., Any]
    #: ``flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``
    varlen_func: Callable[..., Any]
    #: keyword arguments that make ``func`` return ``(out, lse, ...)`` (empty: it cannot, or always does)
    lse_kwargs: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_module(cls, label: str, module: Any) -> FlashKernels:
        """Kernels of a flash-attn-like module; AttributeError if it lacks the flash-attn 2 API."""
        func, varlen_func = module.flash_attn_func, module.flash_attn_varlen_func
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            params = {}
        if "return_lse" in params:  # aiter (its return_attn_probs means the probabilities)
            lse_kwargs = {"return_lse": True}
        elif "return_attn_probs" in params:  # flash-attn 2, recent FA3
            lse_kwargs = {"return_attn_probs": True}
        else:  # early FA3 always returns (out, lse)
            lse_kwargs = {}
        return cls(label, func, varlen_func, lse_kwargs)


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _serves_this_torch(where: str) -> bool:
    rocm = torch.version.hip is not None
    return where == "any" or (where == "rocm") == rocm


def arch_problem(fa_version: int, capability: tuple[int, int], rocm: bool = False) -> str | None:
    """Why a flash-attention ``fa_version`` kernel does not run on a GPU of this compute capability, or None.

    The libraries' own checks (raised at the first forward): FA3 ``is_sm8x = major >= 8`` and flash-attn 2
    ``cc_major >= 8`` (both "FlashAttention only supports Ampere GPUs or newer"; FA3 was sm90-only before).
    ROCm builds check their own targets.
    """
    if rocm:
        return None
    sm = f"sm{capability[0]}{capability[1]}"
    if fa_version == 3 and tuple(capability) < (8, 0):
        return f"FlashAttention-3 needs an Ampere or newer GPU (compute capability >= 8.0), this GPU is {sm}"
    if tuple(capability) < (8, 0):
        return f"flash-attn needs an Ampere or newer GPU (compute capability >= 8.0), this GPU is {sm}"
    return None


def device_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability (initialises CUDA: called per device, never by ``is_available``)."""
    return tuple(torch.cuda.get_device_capability(device))


def initialised_capability() -> tuple[int, int] | None:
    """The current GPU's capability when this process already uses CUDA (a worker), else None: availability
    checks then include the architecture without initialising CUDA themselves (that would poison fork)."""
    if not torch.cuda.is_initialized():
        return None
    return device_capability(torch.device("cuda", torch.cuda.current_device()))


_imported: dict[str, Any] = {}


def _import(name: str) -> Any:
    """The module, or the exception importing it raised (a broken CUDA extension is an OSError/ImportError)."""
    if name not in _imported:
        try:
            _imported[name] = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported as the reason the kernel is unusable
            _imported[name] = exc
    return _imported[name]


def _kernels_of(label: str, mod: str) -> FlashKernels | str:
    """Kernels from one source, or why not."""
    module = _import(mod)
    if isinstance(module, Exception):
        return f"import {mod} failed: {type(module).__name__}: {module}"
    version = getattr(module, "__version__", "")
    try:
        return FlashKernels.from_module(f"{label} {version}".strip(), module)
    except AttributeError:
        if mod == "aiter":  # PyPI's "aiter" is an unrelated package that also imports as aiter
            return (f"the installed aiter {version} has no flash_attn_func/flash_attn_varlen_func: it is not AMD's "
                    f"kernel library, which PyPI calls amd-aiter (pip uninstall aiter; pip install amd-aiter)")
        return f"{mod} {version} has no flash_attn_func/flash_attn_varlen_func ({NAME} needs flash-attn >= 2)"


def select_kernels(capability: tuple[int, int], version: int | None = None) -> FlashKernels | str:
    """The first source, best first, that is installed, imports and is built for this GPU; else why none is."""
    rocm = torch.version.hip is not None
    tried: list[str] = []
    hopper = tuple(capability) == (9, 0)
    # FA3 first on Hopper (its home); elsewhere flash-attn 2 first where both are installed
    for label, mod, fa, where in sorted(SOURCES, key=lambda s: s[2] == 3 and not hopper):
        if (version is not None and fa != version) or not _serves_this_torch(where):
            continue
        if not _module_present(mod):
            tried.append(f"{mod} is not installed")
            continue
        why = arch_problem(fa, capability, rocm)
        if why:
            tried.append(f"{label} ({mod}) is installed but {why}")
            continue
        found = _kernels_of(label, mod)
        if isinstance(found, FlashKernels):
            return found
        tried.append(found)
    return "; ".join(dict.fromkeys(tried)) or "no source applies"


def _find_kernels(device: torch.device, version: int | None) -> FlashKernels:
    if device.type != "cuda":
        raise ComponentUnavailableError(f"{NAME} runs on CUDA/ROCm devices only, got device {device}")
    found = select_kernels(device_capability(device), version)
    if isinstance(found, FlashKernels):
        return found
    pinned = f" with fa_version={version}" if version is not None else ""
    raise ComponentUnavailableError(f"{NAME}: no usable flash attention kernel for {device}{pinned}: {found}. "
                                    f"Use TORCH_SDPA, or {INSTALL_HINT}")


_kernel_cache: dict[tuple[str, int | None], FlashKernels] = {}


def kernels_for(device: torch.device, version: int | None = None) -> FlashKernels:
    """The kernels to run on ``device`` (cached); ComponentUnavailableError saying why when there are none.

    The one place the adapter reaches the library: tests substitute a torch reference here.
    """
    key = (str(device), version)
    if key not in _kernel_cache:
        _kernel_cache[key] = _find_kernels(torch.device(device), version)
    return _kernel_cache[key]


def key_padding_mask(attn_mask: torch.Tensor, batch: int, seq_k: int) -> torch.Tensor:
    """Omni mask -> boolean keep-mask ``[batch, seq_k]``; any mask flash cannot express is refused."""
    mask = tensors.key_padding_mask(attn_mask, batch, seq_k)
    if mask is None:
        raise ComponentUnavailableError(
            f"{NAME} supports only a boolean key-padding mask [batch, seq_k] (or [batch, 1, 1, seq_k]); got a "
            f"{str(attn_mask.dtype).removeprefix('torch.')} mask of shape {tuple(attn_mask.shape)}. Select "
            f"TORCH_SDPA for this layer (attention_config per_role) to apply general masks")
    return mask


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class FlashAttentionImpl(AttentionImpl):
    """Options: ``fa_version`` (2 or 3; default: FA3 on Hopper when installed, else FA2)."""

    def __init__(self, num_heads: int, head_size: int, softmax_scale: float, causal: bool = False,
                 num_kv_heads: int | None = None, **options: Any) -> None:
        unknown = sorted(set(options) - {"fa_version"})
        if unknown:
            raise ConfigError(f"{NAME} got unknown option(s) {', '.join(unknown)}; allowed: fa_version",
                              field="attention_config")
        self.fa_version = options.get("fa_version")
        if self.fa_version not in (None, 2, 3):
            raise ConfigError(f"{NAME} option fa_version must be 2, 3 or unset (automatic), got "
                              f"{self.fa_version!r}", field="attention_config")
        super().__init__(num_heads, head_size, softmax_scale, causal, num_kv_heads, **options)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{NAME} needs heads ({self.num_heads}) divisible by kv heads ({self.num_kv_heads})")

    def _prepare(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 has_mask: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(f"{NAME} needs query, key and value of one dtype, got {query.dtype}, {key.dtype}, "
                             f"{value.dtype}")
        if query.shape[2] % key.shape[2]:
            raise ValueError(f"{NAME} needs query heads ({query.shape[2]}) divisible by key/value heads "
                             f"({key.shape[2]})")
        if self.causal and has_mask:
            raise ValueError(f"{NAME}: pass either causal=True or an attention mask, not both")
        if self.causal and query.shape[1] != key.shape[1]:
            raise ComponentUnavailableError(
                f"{NAME}: causal attention with seq_q ({query.shape[1]}) != seq_k ({key.shape[1]}) is refused: "
                f"Omni's causal mask is top-left aligned (as TORCH_SDPA) and flash-attn's is bottom-right "
                f"aligned. Use TORCH_SDPA for this layer")
        # the kernels need a unit stride on head_dim; other strides they handle
        return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._prepare(query, key, value, attn_mask is not None)
        kernels = kernels_for(q.device, self.fa_version)
        if attn_mask is not None:
            keep = key_padding_mask(attn_mask, q.shape[0], k.shape[1]).to(q.device)
            if not bool(keep.all()):
                return self._forward_varlen(kernels, q, k, v, keep)
        return _first(kernels.func(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal))

    def _forward_varlen(self, kernels: FlashKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        keep: torch.Tensor) -> torch.Tensor:
        """Padded keys dropped: each batch row becomes one sequence of its kept keys (a row with none gives 0)."""
        batch, seq_q, heads, dim = q.shape
        seqlens_k = keep.sum(dim=1, dtype=torch.int32)
        cu_seqlens_k = F.pad(torch.cumsum(seqlens_k, 0, dtype=torch.int32), (1, 0))
        cu_seqlens_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=q.device)
        out = kernels.varlen_func(q.reshape(batch * seq_q, heads, dim), k[keep], v[keep],
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=seq_q,
                                  max_seqlen_k=int(seqlens_k.max()), softmax_scale=self.softmax_scale, causal=False)
        return _first(out).reshape(batch, seq_q, heads, dim)

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's own log-sum-exp (no ``[seq_q, seq_k]`` score matrix), for Ring attention."""
        q, k, v = self._prepare(query, key, value, False)
        kernels = kernels_for(q.device, self.fa_version)
        result = kernels.func(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal, **kernels.lse_kwargs)
        if not isinstance(result, (tuple, list)) or len(result) < 2:
            return super().forward_with_lse(query, key, value)
        return result[0], result[1].float()


class FlashAttentionBackend(AttentionBackend):
    name = NAME
    #: flash-attn 2 and 3: head dims up to 256, multiples of 8 (others are padded inside, at a cost)
    supported_head_sizes = tuple(range(8, 257, 8))
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)
    #: only boolean key-padding masks; other masks raise at the call
    supports_mask = True
    supports_causal = True

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashAttentionImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """A kernel library is installed and imports, and torch is a CUDA/ROCm build; where this process already
        uses CUDA, also one built for the current GPU (see ``check_capability``)."""
        present = [(label, mod) for label, mod, _, where in SOURCES
                   if _serves_this_torch(where) and _module_present(mod)]
        if not present:
            wanted = ", ".join(dict.fromkeys(mod for _, mod, _, where in SOURCES if _serves_this_torch(where)))
            return False, f"no flash attention library is installed (looked for {wanted}); {INSTALL_HINT}"
        if not (torch.version.cuda or torch.version.hip):
            return False, (f"{present[0][1]} is installed but torch {torch.__version__} is built without "
                           f"CUDA/ROCm; {NAME} runs on GPUs only")
        capability = initialised_capability()
        if capability is not None:
            why = cls.check_capability(capability)
            return (False, why) if why else (True, "")
        errors = []
        for label, mod in present:
            found = _kernels_of(label, mod)
            if isinstance(found, FlashKernels):
                return True, ""
            errors.append(found)
        return False, "; ".join(errors)

    @classmethod
    def check_capability(cls, capability: tuple[int, int]) -> str | None:
        """Why no installed source runs on a GPU of this compute capability (e.g. only FA3 on sm80), or None."""
        found = select_kernels(tuple(capability))
        if isinstance(found, FlashKernels):
            return None
        return f"{NAME} cannot run on this sm{capability[0]}{capability[1]} GPU: {found}"
