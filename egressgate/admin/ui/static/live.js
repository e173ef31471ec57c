// Live: one row per audit record the gateway writes, fed by the server-sent events of /ui/api/live.
// Filters are applied by the server (query string); changing them reopens the stream. Rows are
// capped so a busy gateway cannot grow the page without bound.

import {get, query} from "./api.js";
import {clear, el, field, fmtTime, formValues, notice, tableRow, val} from "./dom.js";

const MAX_ROWS = 500;
const FILTERS = ["sandbox", "host", "reason", "decision"];

// Seven columns that fit a 1366-pixel laptop screen: what was asked (kind, method, host:port, path) and what
// was decided (decision, reason, rule) each share one cell; long ids and hashes are cut by CSS only (the
// element's text stays the whole recorded value: find-in-page, copy and the tests see all of it).
export const COLUMNS = [
  {key: "time", label: "Time (UTC)", cls: "nowrap", render: (r) => clock(r.time)},
  {key: "sandbox", label: "Sandbox", cls: "mid", render: (r) => el("div", null, val(r.sandbox, "sandbox"),
    el("div", {class: "sub"}, labels(r.labels)))},
  {key: "request", label: "Request", cls: "wide", render: request},
  {key: "decision", label: "Decision", cls: "mid", render: (r) => el("div", null, decision(r.decision, r.action),
    r.reason ? el("div", {class: "sub"}, val(r.reason, "reason")) : null,
    r.rule ? el("div", {class: "sub"}, "rule ", val(r.rule, "rule")) : null)},
  {key: "status", label: "Status"},
  {key: "ids", label: "Request id · hash", cls: "hash", render: (r) => el("div", null,
    el("div", {class: "cut"}, searchLink("request_id", r.request_id)),
    el("div", {class: "cut"}, searchLink("request_hash", r.request_hash)))},
];

/** The time of day (the date and milliseconds in the title: a live feed is read by the second). */
function clock(t) {
  const full = fmtTime(t);
  return el("span", {"data-field": "time", title: full ? `${full} UTC` : ""}, full ? full.slice(11, 19) : "—");
}

/** kind, then what a request names: method, host[:port], path (only the parts the record has). */
function request(r) {
  const parts = [el("span", {class: "kind", "data-field": "kind"}, String(r.kind ?? "")), " "];
  if (r.method) parts.push(val(r.method, "method"), " ");
  if (r.host !== undefined && r.host !== null && r.host !== "") {
    parts.push(val(r.host, "host"));
    if (r.port !== undefined && r.port !== null && r.port !== "") parts.push(":", val(r.port, "port"));
  }
  if (r.path) parts.push(" ", val(r.path, "path"));
  return el("div", {class: "request"}, parts);
}

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

/** allow / deny as a badge; a record that decides nothing says what it is instead of "—" (an approval's
 * `requested` or `expired` step, a record with no decision at all). */
export function decision(d, action) {
  const cls = d === "allow" ? "ok" : d === "deny" ? "bad" : "pending";
  const text = d != null ? String(d) : action ? String(action) : "no decision";
  return el("span", {class: `badge ${cls}`, "data-field": "decision",
    title: action ? `approval ${action}` : undefined}, text);
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
