// Approvals: the queue of requests waiting for an operator (a sandbox asked for a host its policy
// does not allow). Operators approve (for how long, host or host+path) or deny; auditors only see.

import * as api from "./api.js";
import {clear, el, fmtBytes, fmtCount, notice, table, timeCell, val} from "./dom.js";

const STATES = ["pending", "approved", "denied", "expired", ""];
const CHANGES_SHOWN = 200;  // a write lists up to 100,000 paths: the rest is named, `approvals show` lists all

export function render(root) {
  const select = el("select", {id: "approvals-state", name: "state", "aria-label": "approval state"},
    STATES.map((s) => el("option", {value: s}, s || "all")));
  const refresh = el("button", {type: "button", id: "approvals-refresh"}, "Refresh");
  const out = el("div", {id: "approvals-list"});
  root.append(el("h1", null, "Approvals"), el("div", {class: "filters"}, select, refresh), out);
  let shown = null;  // what the table shows now: re-drawn only when it changes (keeps an operator's inputs)
  const load = async (force = true) => {
    try {
      const data = await api.get(`approvals${api.query({state: select.value})}`);
      const rows = Array.isArray(data.approvals) ? data.approvals : [];
      const key = JSON.stringify(rows);
      if (!force && key === shown) return;
      shown = key;
      // what was asked in one cell (method host:port path), who and what in two more: fits a laptop screen
      const cols = [
        {key: "id", label: "Id", cls: "hash", render: (r) => el("div", {class: "cut"}, val(r.id, "id"))},
        {key: "sandbox_id", label: "Sandbox · policy", cls: "mid", render: (r) => el("div", null,
          val(r.sandbox_id, "sandbox_id"), el("div", {class: "sub"}, val(r.policy, "policy")))},
        {key: "kind", label: "Kind"},
        {key: "request", label: "Request", cls: "wide", render: (r) => r.kind === "persistent_write" ? writeCell(r)
          : el("div", {class: "request"},
            r.method ? [val(r.method, "method"), " "] : null, val(r.host, "host"),
            r.port ? [":", val(r.port, "port")] : null, r.path ? [" ", val(r.path, "path")] : null)},
        {key: "requested_at", label: "Requested", render: (r) => timeCell(r.requested_at, "requested_at")},
        {key: "state", label: "State", render: (r) => el("div", null, val(r.state, "state"),
          r.decided_by ? el("div", {class: "sub"}, "by ", val(r.decided_by, "decided_by")) : null)},
        {key: "expires_at", label: "Expires", render: (r) => timeCell(r.expires_at, "expires_at")},
      ];
      if (api.isOperator()) cols.push({key: "act", label: "Action", render: (r) => actions(r, load, out)});
      clear(out, rows.length ? table(cols, rows, {testid: "approvals-table", rowId: (r) => r.id})
        : notice("info", "No approvals in this state."));
    } catch (err) {
      clear(out, notice("error", err.message));
    }
  };
  select.addEventListener("change", () => load());
  refresh.addEventListener("click", () => load());
  load();
  const timer = setInterval(() => load(false), 3000);  // a queue: new requests show up by themselves
  return () => clearInterval(timer);
}

/** A persistent write (a run's staged workspace changes): one line (workspace, how many changes) that unfolds
 * into the change list, fetched when opened (the list the page polls leaves the paths out: GET one approval). */
function writeCell(row) {
  const details = row.details && typeof row.details === "object" ? row.details : {};
  const body = el("div", {class: "changes"});
  const box = el("details", {class: "write", "data-testid": "write-changes"},
    el("summary", null, "write ", val(details.workspace ?? row.host, "workspace"), " · ",
      fmtCount(details.count, "count"), " changes"), body);
  let loaded = false;
  box.addEventListener("toggle", async () => {
    if (!box.open || loaded) return;
    loaded = true;
    clear(body, notice("info", "Loading the change list…"));
    try {
      const full = await api.get(`approvals/${api.seg(row.id)}`);
      const changes = Array.isArray(full.details?.changes) ? full.details.changes : [];
      const cols = [
        {key: "action", label: "Change", cls: "word"},
        {key: "path", label: "Path", cls: "wide"},
        {key: "size", label: "Size", cls: "word", render: (c) => fmtBytes(c.size, "size")},
        {key: "sha256", label: "sha256", cls: "hash", render: (c) => el("div", {class: "cut"}, val(c.sha256, "sha256"))},
      ];
      const more = changes.length - CHANGES_SHOWN;
      clear(body, table(cols, changes.slice(0, CHANGES_SHOWN), {testid: "write-changes-table"}),
        more > 0 ? notice("info", `${more} more: egressgate approvals show ${row.id}`) : null);
    } catch (err) {
      loaded = false;
      clear(body, notice("error", err.message));
    }
  });
  return box;
}

function actions(row, reload, out) {
  if (row.state !== "pending") return val(null, "actions");
  const seconds = el("input", {type: "number", name: "for_seconds", min: 1, max: 86400, value: 600,
    "aria-label": "for seconds", class: "narrow"});
  const scope = el("select", {name: "scope", "aria-label": "scope"},
    el("option", {value: "host"}, "host"), el("option", {value: "host+path"}, "host+path"));
  const approve = el("button", {type: "button", class: "approve"}, "Approve");
  const deny = el("button", {type: "button", class: "deny"}, "Deny");
  const act = async (verb, body) => {
    approve.disabled = deny.disabled = true;
    try {
      await api.post(`approvals/${api.seg(row.id)}/${verb}`, body);
      await reload(true);
    } catch (err) {
      out.prepend(notice("error", err.message));
      approve.disabled = deny.disabled = false;
    }
  };
  approve.addEventListener("click", () =>
    act("approve", {for_seconds: Number.parseInt(seconds.value, 10), scope: scope.value}));
  deny.addEventListener("click", () => act("deny", {}));
  return el("span", {class: "actions"}, seconds, "s ", scope, approve, deny);
}
