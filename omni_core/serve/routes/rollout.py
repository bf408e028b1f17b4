"""RL routes in the shape of SGLang diffusion's post-training API (issue #52), so a trainer written for it works by
changing the URL: ``POST /rollout/generate`` and the weight routes (``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/get_weights_checksum``, ``/release_memory_occupation``,
``/resume_memory_occupation``). All behind the server's API key.

``/rollout/generate`` takes SGLang's ``RolloutRequest`` fields (``rollout_sde_type``, ``rollout_noise_level``,
``rollout_log_prob_no_const``, ``rollout_sde_step_indices``, ``rollout_debug_mode``, ``rollout_return_dit_trajectory``,
``extra_sampling_params``, ...) and answers a list with one dict per sample (``request_id, prompt, seed,
generated_output, rollout_log_probs, rollout_debug_tensors, denoising_env, dit_trajectory, inference_time_s,
peak_memory_mb``), as ``application/msgpack`` (SGLang's answer) or JSON when the client accepts only that. Every
tensor travels as SGLang sends it: ``{"__tensor__": true, "data": base64 of the safetensors bytes of {"t": tensor},
"shape": [...], "dtype": "torch.float32"}``. ``rollout_log_probs`` holds the SDE steps' log-probs (those of
``rollout_sde_step_indices``, all steps when unset) and ``dit_trajectory.latent_step_indices`` says which steps'
latents ``latents`` holds.

What a request may ask back is bounded by server options (:class:`RolloutLimits`): samples per prompt, steps of
trajectory, bytes of the answer; a request past one is refused naming it before any work.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_core.serve.bodies import read_json
from omni_core.serve.errors import invalid
from omni_core.serve.omni_server import current
from omni_core.serve.openapi import error_doc, error_docs

router = APIRouter(responses={401: error_doc("missing or incorrect API key")})

#: the RolloutRequest fields this route reads (anything else is refused, naming these)
FIELDS = ("model", "prompt", "negative_prompt", "seed", "generator_device", "width", "height", "num_inference_steps",
          "num_outputs_per_prompt", "guidance_scale", "true_cfg_scale", "num_frames", "fps", "rollout",
          "rollout_sde_type", "rollout_noise_level", "rollout_log_prob_no_const", "rollout_debug_mode",
          "rollout_return_denoising_env", "rollout_return_dit_trajectory", "rollout_sde_step_indices",
          "rollout_return_step_indices", "image_path", "suppress_logs", "extra_sampling_params")


@attrs.frozen
class RolloutLimits:
    """What one rollout request may ask back (``omni serve --max-rollout-samples`` / ``--max-rollout-steps`` /
    ``--max-rollout-bytes``)."""

    max_samples: int = 64
    max_trajectory_steps: int = 64
    max_answer_bytes: int = 256 * 1024 * 1024


def encode_tensor(tensor: Any) -> dict:
    from safetensors.torch import save

    data = tensor.detach().to("cpu").contiguous()
    return {"__tensor__": True, "data": base64.b64encode(save({"t": data})).decode("ascii"),
            "shape": list(data.shape), "dtype": str(data.dtype)}


def decode_tensor(value: Any, field: str) -> Any:
    """A tensor sent as SGLang sends one; anything else is a 400 naming ``field``."""
    from safetensors.torch import load

    if not (isinstance(value, dict) and value.get("__tensor__") and isinstance(value.get("data"), str)):
        raise invalid(f"{field} must be a tensor as {{'__tensor__': true, 'data': <base64 safetensors>, ...}}", field)
    try:
        return load(base64.b64decode(value["data"]))["t"]
    except Exception as exc:  # noqa: BLE001 - the client's bytes
        raise invalid(f"{field}: not a safetensors tensor ({type(exc).__name__}: {exc})", field) from None


def _params(body: dict, limits: RolloutLimits) -> tuple[Any, dict]:
    from omni_core.config import SamplingParams
    from omni_core.errors import ConfigError

    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"{unknown[0]!r} is not a RolloutRequest field; known: {', '.join(FIELDS)}", unknown[0])
    if body.get("rollout_return_denoising_env"):
        raise invalid("rollout_return_denoising_env is not offered: replay the step from dit_trajectory and "
                      "rollout_debug_tensors", "rollout_return_denoising_env")
    n = int(body.get("num_outputs_per_prompt") or 1)
    if n > limits.max_samples:
        raise invalid(f"num_outputs_per_prompt={n} exceeds the server's max_rollout_samples={limits.max_samples}",
                      "num_outputs_per_prompt")
    steps = body.get("num_inference_steps")
    trajectory = bool(body.get("rollout_return_dit_trajectory"))
    if trajectory and steps is not None and int(steps) > limits.max_trajectory_steps:
        raise invalid(f"a trajectory of {steps} steps exceeds the server's max_rollout_steps="
                      f"{limits.max_trajectory_steps}", "num_inference_steps")
    fields = {k: body[k] for k in ("seed", "width", "height", "num_inference_steps", "guidance_scale", "num_frames")
              if body.get(k) is not None}
    if body.get("true_cfg_scale") is not None:
        fields["true_cfg_scale"] = body["true_cfg_scale"]
    rollout = None
    if body.get("rollout", True):
        rollout = {"sde_type": body.get("rollout_sde_type") or "sde",
                   "noise_level": body.get("rollout_noise_level", 0.7),
                   "sde_steps": body.get("rollout_sde_step_indices"),
                   "log_prob_constant": not body.get("rollout_log_prob_no_const", False),
                   "trajectory": trajectory, "details": bool(body.get("rollout_debug_mode"))}
    try:
        params = SamplingParams(num_outputs_per_prompt=n, output_type="pt", rollout=rollout,
                                **{**fields, **dict(body.get("extra_sampling_params") or {})})
    except ConfigError as exc:
        raise invalid(f"Invalid sampling params: {exc}", getattr(exc, "field", None)) from None
    return params, body


def _samples(out: Any, prompt: str, seed: Any, elapsed: float) -> list[dict]:
    """One dict per sample, in SGLang's layout."""
    r = out.rollout or {}
    samples = []
    for i in range(out.tensor.shape[0]):
        item: dict[str, Any] = {
            "request_id": f"{out.request_id}-{i}", "prompt": prompt, "seed": seed,
            "generated_output": encode_tensor(out.tensor[i]), "rollout_log_probs": None,
            "rollout_debug_tensors": None, "denoising_env": None, "dit_trajectory": None,
            "inference_time_s": elapsed, "peak_memory_mb": out.metrics.get("peak_memory_mb", 0.0)}
        if r:
            item["rollout_log_probs"] = encode_tensor(r["log_probs"][i])
            if "means" in r:
                item["rollout_debug_tensors"] = {
                    "rollout_prev_sample_means": encode_tensor(r["means"][i]),
                    "rollout_noise_std_devs": encode_tensor(r["stds"]),
                    "rollout_model_outputs": encode_tensor(r["model_outputs"][i])}
            if "latents" in r:
                item["dit_trajectory"] = {"latents": encode_tensor(r["latents"][i]),
                                          "latent_step_indices": [*r["steps"], r["steps"][-1] + 1],
                                          "timesteps": encode_tensor(r["timesteps"]),
                                          "sigmas": encode_tensor(r["sigmas"])}
        samples.append(item)
    return samples


def _answer(request: Request, payload: Any, limits: RolloutLimits) -> Response:
    """msgpack (SGLang's answer) unless the client accepts only JSON; refused past ``max_answer_bytes``."""
    import json

    accept = request.headers.get("accept", "")
    as_json = "application/json" in accept and "msgpack" not in accept
    if as_json:
        body, media = json.dumps(payload).encode(), "application/json"
    else:
        import msgpack

        body, media = msgpack.packb(payload, use_bin_type=True), "application/msgpack"
    if len(body) > limits.max_answer_bytes:
        raise invalid(f"the answer is {len(body)} bytes, over the server's max_rollout_bytes="
                      f"{limits.max_answer_bytes}; ask for fewer samples or no trajectory", "num_outputs_per_prompt")
    return Response(body, media_type=media)


@router.post("/rollout/generate", responses={
    200: {"description": "one dict per sample (application/msgpack; JSON when only that is accepted)"},
    **error_docs(400, 404, 500, 503)})
async def rollout_generate(request: Request):
    server = current(request)
    limits = server.rollout_limits
    body = await read_json(request, server)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object (a RolloutRequest)", None)
    model = server.model(body.get("model"))
    params, body = _params(body, limits)
    t0 = time.perf_counter()
    handle = await model.submit(str(body.get("prompt") or ""), body.get("negative_prompt"), params)
    server.track(handle.request_id, model)
    out = await server.run_to_end(request, handle, model)
    if out is None:
        return Response(status_code=499)
    payload = await asyncio.to_thread(_samples, out, body.get("prompt"), out.metrics.get("seed"),
                                      time.perf_counter() - t0)
    return await asyncio.to_thread(_answer, request, payload, limits)


@router.post("/encode", responses=error_docs(400))
async def encode(request: Request):
    """The model's text encodings of ``prompt`` (and ``negative_prompt`` where the request runs CFG), as tensors."""
    from omni_core.request import OmniDiffusionRequest

    server, body = current(request), await read_json(request, current(request))
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise invalid("prompt: the text to encode", "prompt")
    params, _ = _params({k: v for k, v in body.items() if k not in ("prompt", "negative_prompt", "model")}
                        | {"rollout": False},
                        server.rollout_limits)
    from omni_core.errors import OmniError

    engine = server.model(body.get("model")).engine
    try:
        req = engine.prepare_request(OmniDiffusionRequest(prompt=body["prompt"],
                                                          negative_prompt=body.get("negative_prompt"),
                                                          sampling_params=params))
        (encoded, *_) = await asyncio.to_thread(engine.collective_rpc, "encode_prompt", (req,))
    except OmniError as exc:
        raise invalid(str(exc), getattr(exc, "field", None)) from None
    return JSONResponse({k: (encode_tensor(v) if v is not None else None) for k, v in encoded.items()})


# ---------------------------------------------------------------------------------------------- weights
async def _engine_call(fn: Any, *args: Any) -> Any:
    """A blocking engine call in a thread; an engine error is a 400 naming its field."""
    from omni_core.errors import OmniError

    try:
        return await asyncio.to_thread(fn, *args)
    except OmniError as exc:
        raise invalid(str(exc), getattr(exc, "field", None), code="weight_update_failed") from None


async def _weight_call(server: Any, body: Any, method: str, *args: Any) -> Any:
    """``method`` on the model the body names (the default one when it names none)."""
    return await _engine_call(server.model_of(body).engine.weight_call, method, args)


async def _optional_json(request: Request) -> dict:
    """A body that may be empty (release and resume take none, or ``{"model": ...}``)."""
    server = current(request)
    if not await request.body():
        return {}
    body = await read_json(request, server)
    return body if isinstance(body, dict) else {}


def _target(body: dict) -> str:
    modules = body.get("target_modules") or ["transformer"]
    if not isinstance(modules, list) or len(modules) != 1:
        raise invalid("target_modules names one component (e.g. ['transformer'])", "target_modules")
    return str(modules[0])


@router.post("/update_weights_from_disk", responses=error_docs(400))
async def update_weights_from_disk(request: Request):
    server, body = current(request), await read_json(request, current(request))
    path = (body or {}).get("model_path")
    if not isinstance(path, str):
        raise invalid("model_path: a safetensors file or folder", "model_path")
    target = _target(body)
    import os

    if os.path.isdir(os.path.join(path, target)):  # a pipeline folder: its component's weights
        path = os.path.join(path, target)
    (checksum, *_) = await _weight_call(server, body, "update_weights", path, target, True)
    return JSONResponse({"success": True, "message": "updated", "checksum": checksum})


@router.post("/update_weights_from_tensor", responses=error_docs(400))
async def update_weights_from_tensor(request: Request):
    server, body = current(request), await read_json(request, current(request))
    named = (body or {}).get("serialized_named_tensors")
    if not isinstance(named, dict) or not named:
        raise invalid("serialized_named_tensors: {name: tensor}", "serialized_named_tensors")
    tensors = {name: decode_tensor(value, f"serialized_named_tensors.{name}") for name, value in named.items()}
    strict = (body.get("weight_update_mode") or "full") == "full"
    (checksum, *_) = await _weight_call(server, body, "update_weights", tensors, _target(body), strict)
    return JSONResponse({"success": True, "message": "updated", "checksum": checksum})


@router.post("/get_weights_checksum", responses=error_docs(400))
async def get_weights_checksum(request: Request):
    server, body = current(request), await read_json(request, current(request))
    names = (body or {}).get("module_names") or ["transformer"]
    out = {}
    for name in names:
        (out[name], *_) = await _weight_call(server, body, "weights_checksum", name)
    return JSONResponse(out)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request):
    server = current(request)
    (freed, *_) = await _engine_call(server.model_of(await _optional_json(request)).engine.release_memory)
    return JSONResponse({"success": True, "released_bytes": freed})


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request):
    server = current(request)
    (restored, *_) = await _engine_call(server.model_of(await _optional_json(request)).engine.resume_memory)
    return JSONResponse({"success": True, "restored_bytes": restored})


__all__ = ["RolloutLimits", "decode_tensor", "encode_tensor", "router"]
