// DOM building for the console. Everything the console shows is attacker-influenced (hosts, paths,
// headers and labels come from sandboxes), so this module is the ONLY way pages create nodes:
// text goes in with textContent (never parsed as HTML), attributes only from an allowlist, SVG only
// through createElementNS. There is no innerHTML/insertAdjacentHTML/document.write/eval anywhere in
// the console (tests/console/test_static_sinks.py greps for them).

const SVG_NS = "http://www.w3.org/2000/svg";

// Attributes a page may set. No event handlers (on*), no style, no href/src from data: a value here
// is never executed or fetched by the browser.
const SAFE_ATTRS = new Set([
  "class", "id", "type", "name", "value", "placeholder", "for", "title", "role", "autocomplete",
  "rows", "cols", "min", "max", "step", "spellcheck", "colspan", "aria-label", "aria-live",
  "data-testid", "data-field", "data-id", "download", "wrap",
]);
const SVG_ATTRS = new Set([
  "class", "x", "y", "width", "height", "viewBox", "x1", "x2", "y1", "y2", "text-anchor",
  "dominant-baseline", "transform", "preserveAspectRatio", "role", "aria-label", "data-testid",
  "data-field",
]);
const BOOL_PROPS = new Set(["disabled", "checked", "selected", "required", "hidden", "readOnly"]);

// Bidi controls and other invisible format characters: shown as they are (textContent stays equal
// to the recorded value) but flagged next to the value, and CSS isolates them (unicode-bidi), so an
// RTL override in a host name cannot visually reorder the text around it.
const INVISIBLE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]/gu;

function setAttrs(node, attrs, allowed) {
  for (const [key, val] of Object.entries(attrs || {})) {
    if (val === undefined || val === null || val === false) continue;
    if (BOOL_PROPS.has(key)) { node[key] = Boolean(val); continue; }
    if (!allowed.has(key)) throw new Error(`attribute not allowed: ${key}`);
    node.setAttribute(key, String(val));
  }
}

function append(node, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) { append(node, child); continue; }
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** An HTML element: el("td", {class: "x"}, "text", otherNode). Strings become text nodes. */
export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs, SAFE_ATTRS);
  append(node, children);
  return node;
}

/** An SVG element (createElementNS), for the charts. */
export function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs, SVG_ATTRS);
  append(node, children);
  return node;
}

/** Replace every child of `node`. */
export function clear(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

/** A recorded value as text: a span whose textContent is exactly the value ("—" for none). */
export function val(value, field) {
  if (value === undefined || value === null || value === "") {
    return el("span", {class: "none", "data-field": field}, "—");
  }
  const text = typeof value === "string" ? value : JSON.stringify(value);
  const span = el("span", {class: "v", "data-field": field}, text);
  const hidden = [...new Set(text.match(INVISIBLE) || [])];
  if (hidden.length) {
    // name the characters: an RTL override reorders the value it sits in, the flag says so in plain ASCII
    const names = hidden.slice(0, 4).map((ch) => `U+${ch.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`);
    return el("span", {class: "vwrap"}, span, el("span", {class: "warn", "data-field": "hidden-chars",
      title: "contains invisible or bidi control characters"}, `⚠ ${names.join(" ")}${hidden.length > 4 ? " …" : ""}`));
  }
  return span;
}

/** A table: columns [{key, label, render?}], rows of objects. */
export function table(columns, rows, opts = {}) {
  const head = el("tr", null, columns.map((c) => el("th", null, c.label)));
  const body = el("tbody", null, rows.map((row) => tableRow(columns, row, opts)));
  return el("table", {class: "grid", "data-testid": opts.testid}, el("thead", null, head), body);
}

export function tableRow(columns, row, opts = {}) {
  const tr = el("tr", {"data-id": opts.rowId ? opts.rowId(row) : undefined},
    columns.map((c) => el("td", {class: c.cls}, c.render ? c.render(row) : val(row[c.key], c.key))));
  return tr;
}

/** A labelled input. */
export function field(label, name, attrs = {}) {
  const id = `f-${name}`;
  const input = attrs.multiline
    ? el("textarea", {id, name, rows: attrs.rows || 6, spellcheck: "false", placeholder: attrs.placeholder})
    : el("input", {id, name, type: attrs.type || "text", placeholder: attrs.placeholder,
      value: attrs.value, autocomplete: "off", min: attrs.min, max: attrs.max});
  return el("label", {for: id, class: "field"}, el("span", null, label), input);
}

/** Read the named inputs of a form as strings (trimmed; empty ones left out unless keepEmpty). */
export function formValues(form, keepEmpty = false) {
  const out = {};
  for (const node of form.querySelectorAll("input[name], textarea[name], select[name]")) {
    const v = node.tagName === "TEXTAREA" ? node.value : node.value.trim();
    if (v !== "" || keepEmpty) out[node.name] = v;
  }
  return out;
}

/** A status line (errors from the API are shown with their message, as text). */
export function notice(kind, text) {
  return el("p", {class: `notice ${kind}`, role: kind === "error" ? "alert" : "status"}, text);
}

/** Format a time given in ns, s or an ISO string. */
export function fmtTime(t) {
  if (t === undefined || t === null || t === "") return "";
  let ms;
  if (typeof t === "number") ms = t > 1e17 ? t / 1e6 : t > 1e12 ? t : t * 1000;
  else if (/^\d+$/.test(String(t))) return fmtTime(Number(t));
  else ms = Date.parse(t);
  if (!Number.isFinite(ms)) return String(t);
  return new Date(ms).toISOString().replace("T", " ").replace("Z", "");
}

/** Bytes as an operator reads them ("10.0 MiB"), the exact count in the title. */
export function fmtBytes(n, field = "bytes") {
  const v = Number(n);
  if (n === undefined || n === null || n === "" || !Number.isFinite(v)) return val(n, field);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let x = Math.abs(v), i = 0;
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
  const shown = i === 0 ? String(v) : `${v < 0 ? "-" : ""}${x >= 100 ? x.toFixed(0) : x.toFixed(1)}`;
  return el("span", {class: "num", "data-field": field, title: `${v.toLocaleString("en-US")} bytes`},
    `${shown} ${units[i]}`);
}

/** A count with thousands separators (the exact number in the title). */
export function fmtCount(n, field = "count") {
  const v = Number(n);
  if (n === undefined || n === null || n === "" || !Number.isFinite(v)) return val(n, field);
  return el("span", {class: "num", "data-field": field, title: String(v)}, v.toLocaleString("en-US"));
}

/** A time as "YYYY-MM-DD HH:MM:SS UTC" (what the console shows everywhere), the raw value in the title. */
export function timeCell(t, field = "time") {
  if (t === undefined || t === null || t === "") return val(null, field);
  const text = fmtTime(t);
  return el("span", {class: "time", "data-field": field, title: String(t)}, text ? `${text.slice(0, 19)} UTC` : "");
}

/** A download link for bytes the console itself holds (a Blob): the only href the console sets,
 * and it is always a blob: URL this page created, never a URL taken from data. */
export function blobLink(blob, filename, text) {
  const url = URL.createObjectURL(blob);
  if (!url.startsWith("blob:")) throw new Error("not a blob URL");
  const a = el("a", {download: filename, class: "download", id: "download-link"}, text);
  a.href = url;  // safe-href: blob URL created above
  return a;
}
