// Live: one row per audit record the gateway writes, fed by the server-sent events of /ui/api/live.
// Filters are applied by the server (query string); changing them reopens the stream. Rows are
// capped so a busy gateway cannot grow the page without bound.

import {get, query} from "./api.js";
import {clear, el, field, fmtTime, formValues, notice, tableRow, val} from "./dom.js";

const MAX_ROWS = 500;
const FILTERS = ["sandbox", "host", "reason", "decision"];

export const COLUMNS = [
  {key: "time", label: "Time", render: (r) => el("span", {"data-field": "time"}, fmtTime(r.time))},
  {key: "kind", label: "Kind"},
  {key: "sandbox", label: "Sandbox"},
  {key: "labels", label: "Labels", cls: "wide", render: (r) => labels(r.labels)},
  {key: "method", label: "Method"},
  {key: "host", label: "Host", cls: "wide"},
  {key: "port", label: "Port"},
  {key: "path", label: "Path", cls: "wide"},
  {key: "decision", label: "Decision", render: (r) => decision(r.decision)},
  {key: "reason", label: "Reason"},
  {key: "rule", label: "Rule"},
  {key: "status", label: "Status"},
  {key: "request_id", label: "Request id", render: (r) => searchLink("request_id", r.request_id)},
  {key: "request_hash", label: "Request hash", cls: "hash", render: (r) => searchLink("request_hash", r.request_hash)},
];

/** A value that opens Audit search for it (the hash route carries it URL-encoded; search reads it back
 * with URLSearchParams and puts it in an input's value: never markup, never a URL the browser loads). */
function searchLink(name, value) {
  if (value === undefined || value === null || value === "") return val(null, name);
  const b = el("button", {type: "button", class: "link", title: "find in the audit trail"}, val(value, name));
  b.addEventListener("click", () => {
    location.hash = `#/search?${new URLSearchParams({[name]: String(value)})}`;
  });
  return b;
}

export function decision(d) {
  const cls = d === "allow" ? "ok" : d === "deny" ? "bad" : "";
  return el("span", {class: `badge ${cls}`, "data-field": "decision"}, d == null ? "—" : String(d));
}

export function labels(obj) {
  if (!obj || typeof obj !== "object" || Object.keys(obj).length === 0) return val(null, "labels");
  return el("span", {class: "labels", "data-field": "labels"}, Object.entries(obj).map(([k, v]) =>
    el("span", {class: "label"}, val(k, "label-key"), "=", val(v, "label-value"))));
}

export function render(root) {
  const form = el("form", {class: "filters", id: "live-filters"},
    FILTERS.map((f) => field(f[0].toUpperCase() + f.slice(1), f)),
    el("button", {type: "submit"}, "Apply"),
    el("button", {type: "button", id: "live-pause"}, "Pause"),
    el("button", {type: "button", id: "live-clear"}, "Clear"));
  const status = el("span", {class: "stream-status", id: "live-status", "data-testid": "live-status"}, "connecting");
  const head = el("tr", null, COLUMNS.map((c) => el("th", null, c.label)));
  const body = el("tbody", {id: "live-rows"});
  root.append(el("h1", null, "Live decisions"), form, el("p", null, "Stream: ", status),
    el("div", {class: "scroll"}, el("table", {class: "grid", id: "live-table"}, el("thead", null, head), body)));

  let source = null;
  let paused = false;
  const open = () => {
    if (source) source.close();
    const params = formValues(form);
    const filters = Object.fromEntries(FILTERS.filter((f) => params[f]).map((f) => [f, params[f]]));
    source = new EventSource(`/ui/api/live${query(filters)}`);
    source.addEventListener("open", () => { status.textContent = "live"; });
    source.addEventListener("error", () => {
      const closed = source.readyState === EventSource.CLOSED;
      status.textContent = closed ? "closed" : "reconnecting";
      // EventSource does not say why; if the session ended, asking for it shows the login form
      if (closed) get("session").catch(() => {});
    });
    // the server ends the stream when the session ends (logout anywhere, expiry): back to the login form
    source.addEventListener("logout", () => {
      source.close();
      status.textContent = "closed";
      get("session").catch(() => {});
    });
    source.addEventListener("record", (ev) => {
      if (paused) return;
      let rec;
      try { rec = JSON.parse(ev.data); } catch (_) { return; }
      if (!rec || typeof rec !== "object") return;
      body.prepend(tableRow(COLUMNS, rec, {rowId: (r) => r.request_id}));
      while (body.childElementCount > MAX_ROWS) body.lastElementChild.remove();
    });
  };
  form.addEventListener("submit", (ev) => { ev.preventDefault(); clear(body); open(); });
  form.querySelector("#live-pause").addEventListener("click", (ev) => {
    paused = !paused;
    ev.target.textContent = paused ? "Resume" : "Pause";
  });
  form.querySelector("#live-clear").addEventListener("click", () => clear(body));
  if (typeof EventSource === "undefined") {
    root.append(notice("error", "This browser has no EventSource: the live feed cannot run."));
    return null;
  }
  open();
  return () => { if (source) source.close(); };
}
