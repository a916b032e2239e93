// vllm-steer playground. Plain JS, no dependencies, nothing fetched from outside this server.
// Talks to: GET /v1/steer/info (and GET /v1/steers when the server has it), POST
// /v1/completions or /v1/chat/completions (stream, with the `steer` field), POST
// /v1/steer/highlight. Errors are shown as the server words them.
// A server started with --api-key answers 401 to every /v1 call without the key: the page then
// asks for it (the form at the top), keeps it in this page's memory only (never in storage or
// a cookie; a reload forgets it) and sends it as "Authorization: Bearer KEY" on every call.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  info: { model: null, max_strength: 50, steers: [] },
  strengths: {},        // steer name -> strength shown on its slider / number box
  pinned: [],           // [{steer: {...}, preset?}] extra columns: "Pin current mix", presets
  presets: [],          // [{name, steer}] presets served as model names
  controllers: [],      // AbortControllers of the running generations
  apiKey: "",           // the server's API key as typed (memory only), "" when none given
  needsKey: false,      // the server answered 401: it was started with --api-key
};

// ---------------------------------------------------------------- the server's API
// fetch() of one of this server's API paths, with the API key when one was given.
function api(path, opts) {
  const o = { ...(opts || {}) };
  const headers = { ...(o.headers || {}) };
  if (state.apiKey) headers["Authorization"] = "Bearer " + state.apiKey;
  o.headers = headers;
  return fetch(path, o);
}

const KEY_HELP = "the key the server was started with (vllm serve --api-key KEY, or VLLM_API_KEY)";

// Show the API-key form; `message` says why (no key yet, or the key was refused).
function askKey(message) {
  state.needsKey = true;
  $("key-form").hidden = false;
  showError($("key-error"), message);
  setServer(false, "API key needed");
  $("api-key").focus();
}

async function submitKey(ev) {
  if (ev) ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) {
    showError($("key-error"), `Enter ${KEY_HELP}.`);
    return;
  }
  state.apiKey = key;
  $("api-key").value = "";
  showError($("key-error"), "");
  await loadInfo();
}

// ---------------------------------------------------------------- helpers
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function fmt(x) {  // 2 -> "+2", -2.5 -> "−2.5"
  const s = Math.abs(x).toString();
  return (x < 0 ? "\u2212" : "+") + s;
}

// A strength this server accepts: |v| capped at its maximum (--steer-max-strength), same sign.
function capped(v) {
  const max = state.info.max_strength;
  return typeof max === "number" && Math.abs(v) > max ? Math.sign(v) * max : v;
}

// A steer's recommended strength (from its file), or null when it has none.
function recommended(s) {
  return s && typeof s.recommended_strength === "number" ? s.recommended_strength : null;
}

// The side of a steer that its file marks harmful (labels.harmful: "negative" or "positive"),
// e.g. the negative side of a detox steer, which makes text toxic; null when none is marked.
function harmfulSide(s) {
  const h = s && s.labels && s.labels.harmful;
  return h === "negative" || h === "positive" ? h : null;
}

// The steers of a mix set on the side their file marks harmful: [{name, v, towards}].
function harmfulParts(mix) {
  const by = Object.fromEntries(state.info.steers.map((s) => [s.name, s]));
  return Object.entries(mix || {}).filter(([n, v]) => {
    const h = harmfulSide(by[n]);
    return (h === "negative" && v < 0) || (h === "positive" && v > 0);
  }).map(([n, v]) => ({ name: n, v, towards: (by[n].labels || {})[harmfulSide(by[n])] || "harmful text" }));
}

// The note shown where a recommended strength over the server's maximum is shown.
function capNote(rec) {
  return `capped at \u00B1${Math.abs(capped(rec))}: this server's --steer-max-strength`;
}

function mixLabel(steer) {
  const parts = Object.entries(steer || {}).map(([n, s]) => `${n} ${fmt(s)}`);
  return parts.length ? parts.join(" · ") : "plain";
}

// The message of an error response, as the server gives it (vLLM, FastAPI or plain text).
async function errorMessage(resp) {
  if (resp.status === 401) {  // vLLM's --api-key guard: {"error": "Unauthorized"}
    askKey(state.apiKey ? `The server refused this API key (HTTP 401 Unauthorized): enter ${KEY_HELP}.`
      : `This server needs an API key (HTTP 401 Unauthorized): enter ${KEY_HELP}.`);
    if (state.apiKey) state.apiKey = "";
    return "HTTP 401 Unauthorized: the server needs its API key; enter it in the form at the top.";
  }
  const text = await resp.text();
  let msg = text;
  try {
    const j = JSON.parse(text);
    if (j && j.error) msg = typeof j.error === "string" ? j.error : (j.error.message || JSON.stringify(j.error));
    else if (j && j.message) msg = j.message;
    else if (j && j.detail) msg = typeof j.detail === "string" ? j.detail : JSON.stringify(j.detail);
  } catch (_) { /* not JSON: show the text */ }
  return `HTTP ${resp.status}${resp.statusText ? " " + resp.statusText : ""}: ${msg || "(empty response)"}`;
}

function unreachable(err) {
  setServer(false, `cannot reach the server at ${location.origin}`);
  return `Cannot reach the server at ${location.origin} (is it still running?): ${err.message || err}`;
}

function setServer(ok, text) {
  $("server-dot").className = "dot " + (ok ? "ok" : "down");
  $("server-text").textContent = text;
}

function showError(box, message) {
  box.textContent = message;
  box.hidden = !message;
}

// ---------------------------------------------------------------- steers
// GET /v1/steers (runtime management) in whatever list shape it has -> [{name, ...}]
function normalizeSteers(j) {
  let items = Array.isArray(j) ? j : (j && (j.data || j.steers));
  if (items && !Array.isArray(items) && typeof items === "object")
    items = Object.entries(items).map(([name, v]) => ({ name, ...(v || {}) }));
  if (!Array.isArray(items)) return null;
  return items.map((s) => (typeof s === "string" ? { name: s } : { ...(s.metadata || {}), ...s, name: s.name || s.id }))
    .filter((s) => s.name);
}

async function loadInfo() {
  let info;
  try {
    const r = await api("/v1/steer/info");
    if (r.status === 401) {  // before anything else: ask for the key, load again with it
      await errorMessage(r);
      $("sliders").replaceChildren(el("p", { class: "hint", text: "Enter the server's API key above to list its steers." }));
      return;
    }
    if (!r.ok) throw new Error(await errorMessage(r));
    info = await r.json();
  } catch (e) {
    const msg = e instanceof TypeError ? unreachable(e) : `Could not read the server's steers: ${e.message}`;
    showError($("global-error"), msg);
    $("sliders").replaceChildren(el("p", { class: "hint", text: "No steers: see the error above." }));
    return;
  }
  let source = "GET /v1/steer/info (the steers given to vllm serve --steer)";
  try {  // runtime management, when the server has it, knows steers loaded after start-up
    const r = await api("/v1/steers");
    if (r.ok) {
      const listed = normalizeSteers(await r.json());
      if (listed) {
        const known = Object.fromEntries(info.steers.map((s) => [s.name, s]));
        info.steers = listed.map((s) => ({ ...(known[s.name] || {}), ...s }));
        source = "GET /v1/steers";
      }
    }
  } catch (_) { /* older server: keep the info route's list */ }
  state.info = info;
  $("key-form").hidden = true;  // the key (if any) works
  showError($("global-error"), "");
  state.presets = await loadPresets(info);
  for (const s of info.steers) state.strengths[s.name] = 0;
  // A first press of Generate shows steering: the first steer with a recommended strength
  // (from its file's metadata) starts there, capped at the server's maximum (a file may
  // recommend more than this server allows), on the side its file does not mark harmful;
  // the others at 0.
  const first = info.steers.find((s) => recommended(s) !== null && s.recommended_strength !== 0);
  if (first) {
    const v = capped(first.recommended_strength);
    state.strengths[first.name] = harmfulParts({ [first.name]: v }).length ? -v : v;
  }
  $("steers-source").textContent = `${info.steers.length} steer(s) on this server, from ${source}. ` +
    `Requests may use |strength| up to ${info.max_strength}.`;
  $("steer-count").textContent = `(${info.steers.length})`;
  setServer(true, `${info.model || "model"} · ${info.steers.length} steer(s) · max |strength| ${info.max_strength}`);
  renderSliders();
  renderPresets();
  renderSteerList();
  renderHighlightSteers();
  updateMix();
}

// Presets (served as model names) -> [{name, steer}]: the /v1/models cards that carry a steer
// mix (the server's live list, so a preset added or removed at run time shows on reload), else
// GET /v1/steer/info's "presets" (the --steer-preset ones).
async function loadPresets(info) {
  try {
    const r = await api("/v1/models");
    if (r.ok) {
      const j = await r.json();
      if (Array.isArray(j.data))
        return j.data.filter((m) => m && m.steer && typeof m.steer === "object")
          .map((m) => ({ name: m.id, steer: m.steer }));
    }
  } catch (_) { /* fall back to the info route's list */ }
  return Array.isArray(info.presets) ? info.presets : [];
}

function renderPresets() {
  const presets = state.presets || [];
  $("presets-row").hidden = presets.length === 0;
  $("preset-select").replaceChildren(el("option", { value: "", text: "choose a preset…" }),
    ...presets.map((p) => el("option", { value: p.name, text: `${p.name} (${mixLabel(p.steer)})` })));
}

function addPresetColumn() {
  const name = $("preset-select").value;
  const p = (state.presets || []).find((x) => x.name === name);
  if (!p || state.pinned.some((c) => c.preset === name)) return;
  state.pinned.push({ preset: name, steer: p.steer });
  $("preset-select").value = "";
  renderPinned();
}

function renderSliders() {
  const box = $("sliders");
  const max = state.info.max_strength;
  if (!state.info.steers.length) {
    box.replaceChildren(el("p", { class: "hint", text: "This server has no steers loaded (start it with vllm serve MODEL --steer NAME=PATH)." }));
    return;
  }
  box.replaceChildren(...state.info.steers.map((s) => {
    const id = "sl-" + s.name;
    const rec = recommended(s);
    const over = rec !== null && capped(rec) !== rec;  // the file recommends more than the server allows
    const labels = s.labels || {};
    const range = el("input", { type: "range", id, min: -max, max, step: 0.5, value: 0,
      "aria-describedby": "desc-" + s.name, "data-steer": s.name });
    range.value = String(state.strengths[s.name] || 0);  // after min/max, so it is not clamped
    const num = el("input", { type: "number", id: "num-" + s.name, step: 0.5, value: state.strengths[s.name] || 0,
      class: "num", "aria-label": `${s.name} strength (exact value)`, "data-steer": s.name });
    range.addEventListener("input", () => setStrength(s.name, parseFloat(range.value), "range"));
    num.addEventListener("input", () => setStrength(s.name, num.value === "" ? 0 : parseFloat(num.value), "num"));
    const marks = el("div", { class: "marks", "aria-hidden": "true" });
    const zero = el("span", { class: "mark zero" });
    zero.style.left = pos(0, max);
    marks.append(zero);
    // ▲ at the file's recommended strength; one over the maximum sits at the slider's end
    if (rec !== null) for (const v of [-rec, rec]) {
      const m = el("span", { class: "mark rec" + (over ? " capped" : ""),
        title: `recommended ${fmt(v)}` + (over ? ` (over the server's maximum |strength| ${max})` : ""),
        text: "\u25B2" });
      m.style.left = pos(capped(v), max);
      marks.append(m);
    }
    const recButtons = rec === null ? [] : [-rec, rec].map((v) => el("button", {
      type: "button", class: "small", text: fmt(capped(v)),
      "aria-label": over ? `Set ${s.name} to ${fmt(capped(v))} (recommended ${fmt(v)}, capped at the server's maximum)`
        : `Set ${s.name} to ${fmt(v)} (recommended strength)`,
      onclick: () => setStrength(s.name, capped(v), null) }));
    const poles = [labels.negative ? `negative strengths → ${labels.negative}` : null,
      labels.positive ? `positive strengths → ${labels.positive}` : null].filter(Boolean).join("; ");
    const recText = rec !== null ? `recommended ±${Math.abs(rec)}` : "no recommended strength in the file";
    const harm = harmfulSide(s);
    const harmText = harm ? ` · ${harm} side (${labels[harm] || "harmful"}) marked harmful in the file: ` +
      "−mix columns leave it out unless “Show sides marked harmful” is ticked" : "";
    return el("div", { class: "steer-row" },
      el("div", { class: "steer-head" },
        el("label", { for: id, text: s.name }),
        el("span", { class: "poles", id: "desc-" + s.name },
          el("span", { class: "sr-only", text: poles ? poles + "; " : "" }), recText,
          over ? el("span", { class: "cap", id: "cap-" + s.name, text: ` (${capNote(rec)})` }) : null,
          harm ? el("span", { class: "harm", id: "harm-" + s.name, text: harmText }) : null)),
      el("div", { class: "slider-line" },
        el("div", { class: "slider-wrap" }, range, marks,
          el("div", { class: "ends", "aria-hidden": "true" },
            el("span", { text: "\u2190 " + (labels.negative || "negative") }),
            el("span", { text: (labels.positive || "positive") + " \u2192" }))),
        num, ...recButtons));
  }));
}

function pos(v, max) {  // centre of the range thumb (16px wide) at value v
  const p = (v + max) / (2 * max);
  return `calc(8px + (100% - 16px) * ${p})`;
}

function setStrength(name, v, from) {
  if (!Number.isFinite(v)) return;
  state.strengths[name] = v;
  const range = $("sl-" + name), num = $("num-" + name);
  if (from !== "range") range.value = String(v);
  if (from !== "num") num.value = String(v);
  num.classList.toggle("over", Math.abs(v) > state.info.max_strength);
  num.title = Math.abs(v) > state.info.max_strength ? `over the server's maximum ${state.info.max_strength}: the server will refuse it` : "";
  updateMix();
}

function currentMix() {
  return Object.fromEntries(Object.entries(state.strengths).filter(([, v]) => v !== 0));
}

function negate(mix) {
  return Object.fromEntries(Object.entries(mix).map(([n, v]) => [n, -v]));
}

function updateMix() {
  const mix = currentMix();
  $("mix-summary").textContent = Object.keys(mix).length ? `mix: ${mixLabel(mix)}` : "mix: none (move a slider)";
}

function renderSteerList() {
  const list = $("steer-list");
  if (!state.info.steers.length) {
    list.replaceChildren(el("p", { class: "hint", text: "No steers loaded." }));
    return;
  }
  list.replaceChildren(...state.info.steers.map((s) => {
    const labels = s.labels || {};
    const metrics = s.metrics || {};
    const rows = [
      ["file", s.file], ["error", s.error],
      ["positive strength →", labels.positive], ["negative strength →", labels.negative],
      ["marked harmful in the file", harmfulSide(s) ? `the ${harmfulSide(s)} side` : null],
      ["recommended strength", recommended(s) !== null && capped(s.recommended_strength) !== s.recommended_strength
        ? `${s.recommended_strength} (${capNote(s.recommended_strength)})` : s.recommended_strength], ["rank", s.rank],
      ["hidden size", s.hidden_size], ["epsilon (unit of strength)", s.epsilon],
      ["trained on", s.base_model], ["domain component", s.domain && s.domain !== "none" ? `${s.domain} at ${s.domain_strength}` : s.domain],
      ["dev loss (initial → final)", metrics.dev_loss !== undefined ? `${num3(metrics.dev_loss_initial)} → ${num3(metrics.dev_loss)}` : null],
      ["recommended because", metrics.recommended_strength_rule],
    ].filter(([, v]) => v !== undefined && v !== null && v !== "");
    return el("article", { class: "steer-card", "aria-labelledby": "card-" + s.name },
      el("h2", { id: "card-" + s.name, text: s.name }),
      el("dl", {}, ...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })])),
      el("details", {}, el("summary", { text: "all metadata" }),
        el("pre", { text: JSON.stringify(s, null, 2) })));
  }));
}

function num3(x) { return typeof x === "number" ? x.toFixed(3) : String(x); }

// ---------------------------------------------------------------- compare
function columnsToRun() {
  const mix = currentMix();
  const has = Object.keys(mix).length > 0;
  const cols = [];
  if ($("layout").value === "mirror") {
    // −mix is what nobody asked for by name: a side a steer file marks harmful (the toxic side
    // of detox) is left out, saying why, unless the user ticks "Show sides marked harmful"
    const harm = has ? harmfulParts(negate(mix)) : [];
    if (has) cols.push(harm.length && !$("show-harmful").checked ? { steer: negate(mix), withheld: harm }
      : { steer: negate(mix) });
    cols.push({ steer: null });
    if (has) cols.push({ steer: mix });
  } else {
    cols.push({ steer: null });
    if (has) cols.push({ steer: mix });
  }
  return cols.concat(state.pinned.map((p) => ({ steer: p.steer, pinned: true, preset: p.preset })));
}

function requestBody(steer, preset) {
  const prompt = $("prompt").value;
  const body = { model: preset || state.info.model };
  if ($("endpoint").value === "chat") body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  body.max_tokens = parseInt($("max-tokens").value, 10) || 16;
  body.temperature = parseFloat($("temperature").value) || 0;
  const seed = parseInt($("seed").value, 10);
  if (Number.isFinite(seed)) body.seed = seed;
  if (steer && !preset) body.steer = steer;  // a preset: its model name carries the mix
  body.stream = true;
  return body;
}

function curlFor(path, body) {
  const b = { ...body };
  delete b.stream;
  // the key itself is never written into the page: the command reads it from the shell
  const auth = state.needsKey ? ` -H "Authorization: Bearer $VLLM_API_KEY"` : "";
  return `curl ${location.origin}${path} -H 'Content-Type: application/json'${auth} \\\n  -d '${JSON.stringify(b).replace(/'/g, "'\\''")}'`;
}

async function generate(ev) {
  if (ev) ev.preventDefault();
  stopAll();
  showError($("global-error"), "");
  const path = $("endpoint").value === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const cols = columnsToRun();
  const box = $("columns");
  box.replaceChildren();
  const runs = cols.map((c, i) => {
    if (c.withheld) {
      box.append(withheldColumn(c));
      return null;
    }
    const body = requestBody(c.steer, c.preset);
    const out = el("span", { class: "out", "data-role": "output" });
    const status = el("p", { class: "status", "data-role": "status", text: "waiting…" });
    const err = el("div", { class: "error", role: "alert", "data-role": "error", hidden: true });
    const kind = !c.steer ? "plain" : (Object.values(c.steer).some((v) => v < 0) && !Object.values(c.steer).some((v) => v > 0) ? "neg" : "pos");
    const title = c.preset ? `preset ${c.preset} (${mixLabel(c.steer)})` : mixLabel(c.steer) + (c.pinned ? " (pinned)" : "");
    const col = el("article", { class: `column ${kind}`, "data-steer": c.steer ? JSON.stringify(c.steer) : "",
      "data-preset": c.preset || "", "aria-label": `Output ${title}` },
      el("h2", { text: title }),
      el("div", { class: "text" }, $("endpoint").value === "chat" ? null : el("span", { class: "prompt-echo", text: body.prompt }), out),
      err, status,
      el("details", { class: "req" }, el("summary", { text: "request" }), el("pre", { text: curlFor(path, body) })));
    box.append(col);
    return { col, out, status, err, body, index: i };
  }).filter(Boolean);
  $("generate").disabled = true;
  $("stop").disabled = false;
  await Promise.all(runs.map((r) => stream(path, r)));
  $("generate").disabled = false;
  $("stop").disabled = true;
  const plain = runs.find((r) => !r.body.steer && r.body.model === state.info.model);
  for (const r of runs) if (r !== plain && plain && r.done && plain.done && r.text === plain.text)
    r.status.textContent += " · same text as plain (try a larger strength)";
}

// A column not generated: its mix moves a steer towards the side its file marks harmful.
function withheldColumn(c) {
  const why = c.withheld.map((p) => `${p.name} at ${fmt(p.v)} moves towards ${p.towards}`).join("; ");
  return el("article", { class: "column withheld", "data-steer": JSON.stringify(c.steer),
    "aria-label": `Not generated: ${mixLabel(c.steer)}` },
    el("h2", { text: `${mixLabel(c.steer)} (not generated)` }),
    el("p", { class: "why", "data-role": "why", text: `Not generated: ${why}, the side the steer's file ` +
      "marks harmful (labels.harmful). Tick “Show sides marked harmful” to generate it." }),
    el("button", { type: "button", class: "secondary", "data-role": "show-harmful",
      text: "Generate this side too", onclick: () => { $("show-harmful").checked = true; generate(); } }));
}

async function stream(path, run) {
  const ctl = new AbortController();
  state.controllers.push(ctl);
  run.text = "";
  let tokens = 0, finish = null, failed = false;
  const t0 = performance.now();
  try {
    const resp = await api(path, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(run.body), signal: ctl.signal });
    if (!resp.ok) {
      showError(run.err, await errorMessage(resp));
      run.status.textContent = "refused by the server";
      run.col.classList.add("failed");
      return;
    }
    run.status.textContent = "streaming…";
    run.col.setAttribute("aria-busy", "true");
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        let j;
        try { j = JSON.parse(data); } catch (_) { continue; }
        if (j.error) {  // refused after the stream started (chat validates late): same words
          const e = j.error, code = e.code || e.status_code;
          showError(run.err, (code ? `HTTP ${code}: ` : "error from the server: ") +
            (e.message || JSON.stringify(e)));
          failed = true;
          continue;
        }
        const ch = (j.choices || [])[0];
        if (!ch) continue;
        const piece = ch.text !== undefined ? ch.text : ((ch.delta || {}).content || "");
        if (piece) {
          run.text += piece;
          run.out.append(el("span", { class: "tok", text: piece }));
          tokens += 1;
        }
        if (ch.finish_reason) finish = ch.finish_reason;
      }
    }
    const secs = (performance.now() - t0) / 1000;
    if (failed) {
      run.status.textContent = tokens ? `failed after ${tokens} chunk(s)` : "refused by the server";
      run.col.classList.add("failed");
      return;
    }
    run.done = true;
    run.status.textContent = `${tokens} chunk(s) · ${secs.toFixed(1)} s` + (finish ? ` · finish: ${finish}` : "");
    run.col.classList.add("finished");
  } catch (e) {
    if (e.name === "AbortError") {
      run.status.textContent = "stopped";
    } else {
      showError(run.err, unreachable(e));
      run.status.textContent = "failed";
      run.col.classList.add("failed");
    }
  } finally {
    run.col.removeAttribute("aria-busy");
  }
}

function stopAll() {
  for (const c of state.controllers) c.abort();
  state.controllers = [];
}

function pinMix() {
  const mix = currentMix();
  if (!Object.keys(mix).length) return;
  if (state.pinned.some((p) => JSON.stringify(p.steer) === JSON.stringify(mix))) return;
  state.pinned.push({ steer: mix });
  renderPinned();
}

function renderPinned() {
  const bar = $("pinned-bar");
  bar.hidden = state.pinned.length === 0;
  $("pinned-list").replaceChildren(...state.pinned.map((p, i) => el("button", {
    type: "button", class: "chip", text: (p.preset ? `preset ${p.preset}` : mixLabel(p.steer)) + " \u00D7",
    "aria-label": `Remove pinned column ${p.preset ? "preset " + p.preset : mixLabel(p.steer)}`,
    onclick: () => { state.pinned.splice(i, 1); renderPinned(); } })));
}

// ---------------------------------------------------------------- highlight
function renderHighlightSteers() {
  const sel = $("hl-steer");
  sel.replaceChildren(...state.info.steers.map((s) => el("option", { value: s.name, text: s.name })));
  // the strength box starts at the chosen steer's recommended strength, capped at the
  // server's maximum (the note under it says so)
  const start = (s) => {
    const rec = recommended(s), note = $("hl-cap");
    if (rec !== null) $("hl-strength").value = capped(rec);
    note.textContent = rec !== null && capped(rec) !== rec ? `${s.name}: recommended ${fmt(rec)}, ${capNote(rec)}.` : "";
    note.hidden = !note.textContent;
  };
  start(state.info.steers[0]);
  sel.onchange = () => start(state.info.steers.find((x) => x.name === sel.value));  // once, also on a reload
}

async function highlight(ev) {
  if (ev) ev.preventDefault();
  const errBox = $("hl-error"), out = $("hl-out");
  showError(errBox, "");
  const name = $("hl-steer").value;
  const body = { text: $("hl-text").value, steer: { [name]: parseFloat($("hl-strength").value) },
    k: parseInt($("hl-k").value, 10) || 3, max_len: parseInt($("hl-maxlen").value, 10) || 8 };
  $("hl-run").disabled = true;
  out.replaceChildren(el("p", { class: "hint", text: "scoring…" }));
  try {
    const r = await api("/v1/steer/highlight", { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (!r.ok) {
      out.replaceChildren();
      let msg = await errorMessage(r);
      if (r.status === 404) msg += " (the highlight route comes with VLLM_PLUGINS=vllm_steer,vllm_steer_lens)";
      showError(errBox, msg);
      return;
    }
    renderHighlight(await r.json(), name);
  } catch (e) {
    out.replaceChildren();
    showError(errBox, unreachable(e));
  } finally {
    $("hl-run").disabled = false;
  }
}

function renderHighlight(j, name) {
  const out = $("hl-out");
  const scores = j.scores || [];
  const scale = Math.max(1e-9, ...scores.filter((s) => s !== null).map(Math.abs));
  const owner = new Array(j.tokens.length).fill(-1);
  // boxes numbered by score: 1 is the span most in favour of the steer
  const best = (j.spans || []).map((sp, r) => ({ ...sp, r })).sort((a, b) => b.score - a.score);
  const rankOf = {};
  best.forEach((sp, i) => { rankOf[sp.r] = i + 1; });
  (j.spans || []).forEach((sp, r) => { for (let i = sp.start; i < sp.end; i++) owner[i] = r; });
  const text = el("p", { class: "hl-text" });
  let i = 0;
  while (i < j.tokens.length) {
    if (owner[i] >= 0) {
      const r = owner[i], sp = j.spans[r];
      const mark = el("mark", { class: "span", title: `span ${rankOf[r]}: score ${sp.score.toFixed(3)}` },
        el("span", { class: "rank", "aria-hidden": "true", text: String(rankOf[r]) }));
      for (; i < sp.end; i++) mark.append(tokenEl(j.tokens[i], scores[i], scale));
      text.append(mark);
    } else {
      text.append(tokenEl(j.tokens[i], scores[i], scale));
      i += 1;
    }
  }
  const steerDesc = mixLabel(j.steer || {});
  const list = best.length ? el("ol", { class: "spans" }, ...best.map((sp) =>
    el("li", {}, el("q", { text: sp.text.trim() }), ` score ${sp.score.toFixed(3)}`))) :
    el("p", { class: "hint no-spans", text: `No span of this text is more likely with ${steerDesc} than without it ` +
      "(every token scores ≤ 0): try a smaller strength, the opposite sign or another text." });
  out.replaceChildren(
    el("p", { class: "legend" },
      el("span", { class: "sw pos" }), ` more likely with ${steerDesc} than with the plain model`,
      el("span", { class: "sw neg" }), " less likely. Numbered boxes: the best spans."),
    text,
    el("h3", { text: `Best spans for ${steerDesc}` }), list);
}

function tokenEl(tok, score, scale) {
  const t = el("span", { class: "t", text: tok });
  if (score !== null && score !== undefined) {
    const a = Math.min(1, Math.abs(score) / scale) * 0.75;
    t.style.backgroundColor = score >= 0 ? `rgba(22, 163, 74, ${a})` : `rgba(220, 38, 38, ${a})`;
    t.title = `${JSON.stringify(tok)}: ${score >= 0 ? "+" : ""}${score.toFixed(3)}`;
    t.dataset.score = String(score);
  }
  return t;
}

// ---------------------------------------------------------------- tabs
function selectTab(tab, focus) {
  for (const t of document.querySelectorAll('[role="tab"]')) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  if (focus) tab.focus();
  history.replaceState(null, "", "#" + tab.id.replace("tab-", ""));
}

function setupTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((t, i) => {
    t.addEventListener("click", () => selectTab(t, false));
    t.addEventListener("keydown", (e) => {
      const j = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[e.key];
      if (j === undefined) return;
      e.preventDefault();
      selectTab(tabs[(j + tabs.length) % tabs.length], true);
    });
  });
  const want = $("tab-" + location.hash.slice(1));
  if (want) selectTab(want, false);
}

// ---------------------------------------------------------------- start
document.addEventListener("DOMContentLoaded", () => {
  setupTabs();
  $("compare-form").addEventListener("submit", generate);
  $("highlight-form").addEventListener("submit", highlight);
  $("key-form").addEventListener("submit", submitKey);
  $("stop").addEventListener("click", stopAll);
  $("pin").addEventListener("click", pinMix);
  $("add-preset").addEventListener("click", addPresetColumn);
  $("reset-sliders").addEventListener("click", () => {
    for (const n of Object.keys(state.strengths)) setStrength(n, 0, null);
  });
  for (const id of ["prompt", "hl-text"]) $(id).addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      (id === "prompt" ? generate : highlight)();
    }
  });
  loadInfo();
});
