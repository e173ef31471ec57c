// The auditor's tools: request-hash calculator, policy explain, replay-diff of a candidate policy
// against recorded traffic, and `policy learn` as a YAML download. All of them only compute (no
// state changes); they are POSTs so they still carry the CSRF token.

import * as api from "./api.js";
import {blobLink, clear, el, field, fmtTime, formValues, notice, tableRow, val} from "./dom.js";

function page(root, title, intro, fields, submit, handler) {
  const out = el("div", {class: "result", id: `${submit}-result`});
  const form = el("form", {class: "stack", id: `${submit}-form`}, fields,
    el("button", {type: "submit", id: `${submit}-submit`}, title));
  root.append(el("h1", null, title), el("p", null, intro), form, out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    clear(out, notice("info", "working…"));
    try {
      clear(out, await handler(formValues(form), form));
    } catch (err) {
      clear(out, notice("error", err.message));
    }
  });
  return null;
}

/** "Name: value" lines -> [[name, value], ...] (order and repeats kept: both are part of the hash). */
function parseHeaders(text) {
  const out = [];
  for (const line of (text || "").split(/\r?\n/)) {
    if (!line.trim()) continue;
    const i = line.indexOf(":");
    if (i <= 0) throw new Error(`not a header line (Name: value): ${line}`);
    out.push([line.slice(0, i).trim(), line.slice(i + 1).trim()]);
  }
  return out;
}

/** "k=v" lines (or comma-separated) -> {k: v}. */
function parseLabels(text) {
  const out = {};
  for (const part of (text || "").split(/[\n,]/)) {
    if (!part.trim()) continue;
    const i = part.indexOf("=");
    if (i <= 0) throw new Error(`not a label (key=value): ${part}`);
    out[part.slice(0, i).trim()] = part.slice(i + 1).trim();
  }
  return out;
}

function utf8Base64(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

function kv(pairs) {
  return el("dl", {class: "facts"}, pairs.map(([k, v, name]) => [el("dt", null, k), el("dd", null, val(v, name))]));
}

export function renderHash(root) {
  const b64 = el("input", {type: "checkbox", name: "body_is_b64", id: "f-body_is_b64"});
  return page(root, "Request hash",
    "Computes egressgate.request.hash the way the gateway does (docs/audit.md), from a captured request.",
    [field("Method", "method", {value: "GET"}), field("URL", "url", {placeholder: "https://api.example/v1/x"}),
      field("Headers (one per line, Name: value)", "headers", {multiline: true, rows: 4}),
      field("Body", "body", {multiline: true, rows: 4}),
      el("label", {class: "check", for: "f-body_is_b64"}, b64, "body is base64")],
    "hash", async (v) => {
      const body = v.body || "";
      const res = await api.post("request-hash", {method: v.method || "GET", url: v.url || "",
        headers: parseHeaders(v.headers), body_b64: b64.checked ? body.trim() : utf8Base64(body)});
      return [kv([["Request hash", res.request_hash, "request_hash"]]),
        el("h3", null, "Canonical form"), el("pre", {class: "record", "data-field": "canonical"},
          typeof res.canonical === "string" ? res.canonical : JSON.stringify(res.canonical, null, 2))];
    });
}

export function renderExplain(root) {
  return page(root, "Explain",
    "Why a request would be allowed or denied: a policy by name (active set) or pasted YAML.",
    [field("Policy name", "policy"), field("or policy YAML", "policy_yaml", {multiline: true, rows: 8}),
      field("Method", "method", {value: "GET"}), field("URL", "url"),
      field("Labels (k=v, one per line)", "labels", {multiline: true, rows: 2})],
    "explain", async (v) => {
      const body = {method: v.method || "GET", url: v.url || "", labels: parseLabels(v.labels)};
      if (v.policy_yaml && v.policy_yaml.trim()) body.policy_yaml = v.policy_yaml;
      else body.policy = v.policy || "";
      const res = await api.post("explain", body);
      return kv([["Decision", res.decision, "decision"], ["Reason", res.reason, "reason"],
        ["Rule", res.rule, "rule"], ["Message", res.message, "message"]]);
    });
}

/** One decision as "decision (rule, reason)". */
function outcome(o, field) {
  if (!o || typeof o !== "object") return val(o, field);
  return el("span", {class: "outcome"}, decisionBadge(o.decision, field),
    o.rule ? [" rule ", val(o.rule, `${field}-rule`)] : null,
    o.reason ? [" reason ", val(o.reason, `${field}-reason`)] : null);
}

function decisionBadge(d, field) {
  const cls = d === "allow" ? "ok" : d === "deny" ? "bad" : "";
  return el("span", {class: `badge ${cls}`, "data-field": field}, d == null ? "—" : String(d));
}

const FLIP_COLUMNS = [
  {key: "time_ns", label: "Time", render: (f) => fmtTime(f.time_ns)},
  {key: "sandbox", label: "Sandbox"},
  {key: "operation", label: "Operation"},
  {key: "target", label: "Target", cls: "wide"},
  {key: "direction", label: "Flip"},
  {key: "old", label: "Recorded", render: (f) => outcome(f.old, "old")},
  {key: "new", label: "Candidate", render: (f) => outcome(f.new, "new")},
  {key: "request_id", label: "Request id"},
  {key: "line", label: "Where", render: (f) => [val(f.file, "file"), ":", val(f.line, "line")]},
];

export function flipsTable(flips) {
  return el("table", {class: "grid", "data-testid": "flips-table"},
    el("thead", null, el("tr", null, FLIP_COLUMNS.map((c) => el("th", null, c.label)))),
    el("tbody", null, flips.map((f) => {
      const tr = tableRow(FLIP_COLUMNS, f || {});
      tr.classList.add("flip");
      return tr;
    })));
}

export function renderReplay(root) {
  return page(root, "Replay diff",
    "Replays recorded decisions against a candidate policy and lists every decision that would flip.",
    [field("Candidate policy YAML", "policy_yaml", {multiline: true, rows: 12}),
      field("Sandbox (optional)", "sandbox"), field("Limit", "limit", {type: "number", value: "1000", min: 1})],
    "replay", async (v) => {
      const body = {policy_yaml: v.policy_yaml || ""};
      if (v.sandbox) body.sandbox = v.sandbox;
      if (v.limit) body.limit = Number.parseInt(v.limit, 10);
      const res = await api.post("replay-diff", body);
      const flips = Array.isArray(res) ? res : Array.isArray(res.flips) ? res.flips : [];
      const summary = [];
      for (const k of ["replayed", "unchanged"]) if (res[k] !== undefined) summary.push(`${k}: ${res[k]}`);
      if (res.truncated) summary.push("truncated at the limit");
      return [el("p", {id: "flip-count"}, `${flips.length} decision${flips.length === 1 ? "" : "s"} would flip`,
        summary.length ? ` (${summary.join(", ")})` : ""), flips.length ? flipsTable(flips) : null];
    });
}

export function renderLearn(root) {
  return page(root, "Learn",
    "Proposes the smallest rules that would allow what a sandbox (or sandboxes with these labels) was denied.",
    [field("Sandbox id", "sandbox"), field("or labels (k=v, one per line)", "labels", {multiline: true, rows: 2})],
    "learn", async (v) => {
      const body = v.sandbox ? {sandbox: v.sandbox} : {labels: parseLabels(v.labels)};
      const res = await api.postRaw("learn", body);
      const blob = await res.blob();
      const text = await blob.text();
      const name = `learned-${(v.sandbox || "labels").replace(/[^A-Za-z0-9_.-]/g, "_").slice(0, 60)}.yaml`;
      return [el("p", null, blobLink(new Blob([text], {type: "application/yaml"}), name, `Download ${name}`)),
        el("pre", {class: "record", id: "learn-yaml", "data-field": "policy_yaml"}, text)];
    });
}
