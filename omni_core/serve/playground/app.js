// Omni playground: plain JavaScript, no build step, no CDN (the page works offline).
// It uses only the public API: GET /v1/models, POST /v1/images/generations (stream=true: server-sent events, read
// with fetch + ReadableStream since EventSource cannot POST), POST /v1/images/edits (image-input models), and the
// /v1/videos jobs. Stop aborts the fetch: the server aborts a request whose client went away (at the next step).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, controller: null, videoId: null, busy: false };

function key() { return $("api-key").value.trim(); }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}

/** The server's own words for a failed response (the OpenAI error shape), else the HTTP status. */
async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}` + (text ? `: ${text}` : "");
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setStatus(text) { $("status").textContent = text; }

function setBusy(busy) {
  state.busy = busy;
  $("generate").disabled = busy;
  $("stop").disabled = !busy;
}

function setProgress(done, total) {
  $("progress").max = Math.max(total, 1);
  $("progress").value = done;
}

// ------------------------------------------------------------------ models
async function loadModels() {
  showError("");
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    showError("cannot reach the server: " + e.message);
    return;
  }
  if (!response.ok) {
    const message = await errorText(response);
    showError(message);
    if (response.status === 401) $("api-key").focus();
    return;
  }
  const models = (await response.json()).data || [];
  const select = $("model");
  select.innerHTML = "";
  for (const m of models) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.id;
    select.appendChild(option);
  }
  state.models = models;
  $("generate").disabled = models.length === 0;
  pickModel();
}

function pickModel() {
  const m = (state.models || []).find((x) => x.id === $("model").value) || null;
  state.model = m;
  if (!m) return;
  const video = m.modality === "video";
  const input = m.image_input || null;
  for (const el of document.querySelectorAll(".video-only")) el.hidden = !video;
  for (const el of document.querySelectorAll(".image-only")) el.hidden = !input;
  if (input) {
    $("image-label").textContent = `Input image (${input.role || "input"})`;
    $("image").multiple = input.max_images > 1;
  }
  const facts = [m.pipeline, m.modality];
  if (m.size_multiple) facts.push(`sizes: multiples of ${m.size_multiple}`);
  if (m.limits && m.limits.max_pixels) facts.push(`at most ${m.limits.max_pixels} pixels`);
  if (m.limits && m.limits.max_steps) facts.push(`at most ${m.limits.max_steps} steps`);
  if (!video && !m.streaming_previews) facts.push("no live previews (server started with --no-stream-previews)");
  $("model-info").textContent = facts.filter(Boolean).join(" · ");
  $("server-info").textContent = `serving ${m.id}`;
}

// ------------------------------------------------------------------ the request
/** The settings the user filled in (empty fields are left to the model's defaults). */
function settings() {
  const s = { prompt: $("prompt").value };
  const text = { negative_prompt: "negative-prompt", size: "size", lora: "lora" };
  const numbers = { num_inference_steps: "steps", guidance_scale: "guidance", seed: "seed", lora_scale: "lora-scale" };
  if (state.model && state.model.modality === "video") Object.assign(numbers, { num_frames: "frames", fps: "fps" });
  for (const [field, id] of Object.entries(text)) if ($(id).value.trim()) s[field] = $(id).value.trim();
  for (const [field, id] of Object.entries(numbers)) if ($(id).value.trim() !== "") s[field] = Number($(id).value);
  if (s.lora === undefined) delete s.lora_scale;  // a scale without an adapter means nothing
  if (state.model) s.model = state.model.id;
  return s;
}

function formOf(fields, fileField, files) {
  const form = new FormData();
  for (const [k, v] of Object.entries(fields)) form.append(k, String(v));
  const name = files.length > 1 ? fileField + "[]" : fileField;  // several images: OpenAI's image[]
  for (const file of files) form.append(name, file, file.name);
  return form;
}

async function generate(event) {
  if (event) event.preventDefault();
  if (state.busy) return;
  if (!state.model) await loadModels();  // e.g. the key was typed after a 401
  if (!state.model) return;
  showError("");
  const s = settings();
  // without an image the request goes to generations: a model that needs one says so (its own words)
  const files = state.model.image_input ? Array.from($("image").files) : [];
  $("preview").removeAttribute("src");
  setProgress(0, s.num_inference_steps || 1);
  setBusy(true);
  state.controller = new AbortController();
  const started = performance.now();
  try {
    if (state.model.modality === "video") await runVideo(s, files);
    else await runImage(s, files);
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped");
    else showError(e.message || String(e));
  } finally {
    state.controller = null;
    state.videoId = null;
    setBusy(false);
  }
  if ($("status").textContent === "done") setStatus(`done in ${((performance.now() - started) / 1000).toFixed(1)} s`);
}

async function runImage(s, files) {
  const stream = !!state.model.streaming_previews;
  // step_previews: omni's extension, a preview after every step (OpenAI's partial_images sends at most 3)
  const body = Object.assign({}, s, stream ? { stream, step_previews: true } : { stream });
  const init = { method: "POST", signal: state.controller.signal };
  let url = "/v1/images/generations";
  if (files.length) {
    url = "/v1/images/edits";
    init.body = formOf(body, "image", files);
    init.headers = headers();
  } else {
    init.body = JSON.stringify(body);
    init.headers = headers({ "Content-Type": "application/json" });
  }
  setStatus("queued");
  const response = await fetch(url, init);
  if (!response.ok) {
    showError(await errorText(response));
    setStatus("failed");
    return;
  }
  if (!stream) {
    const out = await response.json();
    finishImage(out.data[0].b64_json, s, out.seed);
    return;
  }
  let ended = false;
  for await (const [name, data] of events(response)) {
    // generations stream image_generation.*, edits image_edit.* (OpenAI's names)
    if (name.endsWith(".partial_image")) {
      $("preview").src = "data:image/png;base64," + data.b64_json;
      $("preview").dataset.step = String(data.step);  // 1-based: the i-th preview comes after step i
      setProgress(data.step, data.num_steps);
      setStatus(`step ${data.step} / ${data.num_steps}`);
    } else if (name.endsWith(".completed")) {
      if (data.index === 0) finishImage(data.b64_json, s, data.seed);
      ended = true;
    } else if (name === "error") {
      showError((data.error && data.error.message) || JSON.stringify(data));
      setStatus("failed");
      ended = true;
    }
  }
  if (!ended) { showError("the server closed the stream before the result"); setStatus("failed"); }
}

function finishImage(b64, s, seed) {
  const src = "data:image/png;base64," + b64;
  $("video").hidden = true;
  $("result").hidden = false;
  $("result").src = src;
  $("progress").value = $("progress").max;
  setStatus("done");
  addHistory("img", src, Object.assign({}, s, { seed }));
}

/** Server-sent events of a fetch response: yields [event name, parsed data]. */
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) yield [name, JSON.parse(data)];
    }
  }
}

async function runVideo(s, files) {
  const init = { method: "POST", signal: state.controller.signal };
  if (files.length) {
    init.body = formOf(s, "input_reference", files.slice(0, 1));
    init.headers = headers();
  } else {
    init.body = JSON.stringify(s);
    init.headers = headers({ "Content-Type": "application/json" });
  }
  const response = await fetch("/v1/videos", init);
  if (!response.ok) { showError(await errorText(response)); setStatus("failed"); return; }
  let job = await response.json();
  state.videoId = job.id;
  setProgress(0, 100);
  while (job.status === "queued" || job.status === "in_progress") {
    setStatus(`${job.status.replace("_", " ")} ${job.progress || 0}%`);
    setProgress(job.progress || 0, 100);
    await sleep(400, state.controller.signal);
    const r = await fetch(`/v1/videos/${job.id}`, { headers: headers(), signal: state.controller.signal });
    if (!r.ok) { showError(await errorText(r)); setStatus("failed"); return; }
    job = await r.json();
  }
  if (job.status !== "completed") {
    showError((job.error && job.error.message) || `the video job ${job.status}`);
    setStatus("failed");
    return;
  }
  const content = await fetch(`/v1/videos/${job.id}/content`, { headers: headers(), signal: state.controller.signal });
  if (!content.ok) { showError(await errorText(content)); setStatus("failed"); return; }
  const src = URL.createObjectURL(await content.blob());
  $("result").hidden = true;
  $("video").hidden = false;
  $("video").src = src;
  setProgress(100, 100);
  setStatus("done");
  addHistory("video", src, Object.assign({}, s, { seed: job.seed }));
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); reject(new DOMException("stopped", "AbortError")); });
  });
}

function stop() {
  if (state.videoId) {  // a video job runs on the server without us: cancel it there
    fetch(`/v1/videos/${state.videoId}`, { method: "DELETE", headers: headers() });
  }
  if (state.controller) state.controller.abort();
}

// ------------------------------------------------------------------ history
function addHistory(kind, src, s) {
  const item = document.createElement("li");
  const media = document.createElement(kind);
  media.src = src;
  if (kind === "video") { media.muted = true; media.loop = true; media.autoplay = true; }
  const text = document.createElement("div");
  text.className = "settings";
  text.textContent = Object.entries(s).filter(([k]) => k !== "model").map(([k, v]) => `${k}: ${v}`).join("\n");
  item.append(media, text);
  item.title = "click to reuse these settings";
  item.addEventListener("click", () => reuse(s));
  $("history").prepend(item);
}

function reuse(s) {
  const ids = { prompt: "prompt", negative_prompt: "negative-prompt", size: "size", num_inference_steps: "steps",
                guidance_scale: "guidance", seed: "seed", lora: "lora", lora_scale: "lora-scale",
                num_frames: "frames", fps: "fps" };
  for (const [field, id] of Object.entries(ids)) $(id).value = s[field] === undefined || s[field] === null ? "" : s[field];
}

// ------------------------------------------------------------------ wiring
$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", stop);
$("model").addEventListener("change", pickModel);
$("connect").addEventListener("click", loadModels);
$("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); loadModels(); } });
loadModels();
