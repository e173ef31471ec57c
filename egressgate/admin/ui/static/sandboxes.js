// Sandboxes: labels, policy, usage against budgets, live connections, and Revoke for operators.
// For an auditor the Revoke control is not rendered at all (and the API answers 403 anyway: the
// server is the authority, hiding the button is only so nobody is invited to click it).

import * as api from "./api.js";
import {clear, el, fmtBytes, fmtCount, notice, table, timeCell, val} from "./dom.js";
import {labels} from "./live.js";

export function render(root) {
  const list = el("div", {id: "sandbox-list"});
  const detail = el("div", {id: "sandbox-detail", class: "detail"});
  const refresh = el("button", {type: "button", id: "sandboxes-refresh"}, "Refresh");
  root.append(el("h1", null, "Sandboxes"), el("div", {class: "filters"}, refresh), list, detail);
  const load = async () => {
    try {
      const data = await api.get("sandboxes");
      const rows = Array.isArray(data.sandboxes) ? data.sandboxes : [];
      clear(list, rows.length ? table([
        {key: "id", label: "Id", render: (r) => openButton(r, detail)},
        {key: "policy", label: "Policy"},
        {key: "labels", label: "Labels", render: (r) => labels(r.labels)},
        {key: "admitted_at", label: "Admitted", render: (r) => timeCell(r.admitted_at, "admitted_at")},
        {key: "revoked", label: "State", render: (r) => stateBadge(r.revoked)},
        {key: "connections", label: "Connections"},
      ], rows, {testid: "sandbox-table", rowId: (r) => r.id}) : notice("info", "No sandboxes admitted."));
    } catch (err) {
      clear(list, notice("error", err.message));
    }
  };
  refresh.addEventListener("click", load);
  load();
  return null;
}

function stateBadge(revoked) {
  return el("span", {class: `badge ${revoked ? "bad" : "ok"}`, "data-field": "state"}, revoked ? "revoked" : "active");
}

function openButton(row, detail) {
  const b = el("button", {type: "button", class: "link", "data-testid": "open-sandbox"}, val(row.id, "id"));
  b.addEventListener("click", () => showDetail(String(row.id), detail));
  return b;
}

export async function showDetail(id, detail) {
  clear(detail, notice("info", "loading…"));
  let s;
  try {
    s = await api.get(`sandboxes/${api.seg(id)}`);
  } catch (err) {
    clear(detail, notice("error", err.message));
    return;
  }
  const facts = el("dl", {class: "facts"},
    el("dt", null, "Id"), el("dd", null, val(s.id, "id")),
    el("dt", null, "Policy"), el("dd", null, val(s.policy, "policy")),
    el("dt", null, "Policy hash"), el("dd", null, val(s.policy_hash, "policy_hash")),
    el("dt", null, "Labels"), el("dd", null, labels(s.labels)),
    el("dt", null, "Admitted"), el("dd", null, timeCell(s.admitted_at, "admitted_at")),
    el("dt", null, "State"), el("dd", null, stateBadge(s.revoked)),
    el("dt", null, "Live connections"), el("dd", {"data-testid": "connections"}, connections(s.connections)));
  const parts = [el("h2", null, "Sandbox ", val(s.id, "id")), facts, usage(s.usage), budgets(s.budgets)];
  if (api.isOperator() && !s.revoked) parts.push(revokeControl(id, detail));
  clear(detail, parts);
}

function connections(c) {
  if (Array.isArray(c)) {
    return c.length ? el("ul", null, c.map((x) => el("li", null, val(x, "connection")))) : "0";
  }
  return val(c, "connections");
}

/** A usage or budget amount in its unit: bytes as KiB/MiB, counts with separators. */
function amount(n, bytes) {
  return bytes ? fmtBytes(n) : fmtCount(n);
}

function usage(u) {
  if (!u) return null;
  const rows = [["bytes out", u.bytes_out, true], ["bytes in", u.bytes_in, true], ["DNS queries", u.dns_queries],
    ["DNS name bytes", u.dns_name_bytes, true], ["hosts contacted", u.hosts_contacted]];
  for (const [rule, ru] of Object.entries(u.rules || {})) {
    rows.push([`rule ${rule} requests`, ru.requests], [`rule ${rule} bytes`, ru.bytes, true]);
  }
  return el("div", null, el("h3", null, "Usage"), table([{key: 0, label: "What"},
    {key: 1, label: "Used", render: (r) => amount(r[1], r[2])}], rows, {testid: "usage-table"}));
}

function budgetRow(name, b, bytes = false) {
  if (!b) return null;
  const limit = Number(b.limit), used = Number(b.used);
  const meter = el("meter", {min: 0, max: limit, value: Math.min(used, limit), title: `${used} of ${limit}`,
    "aria-label": `${name}: ${used} of ${limit} used`});
  return {name, used, limit, left: b.left, meter, bytes};
}

function budgets(bs) {
  if (!bs) return el("p", {class: "notice info"}, "The sandbox's policy is not in the active set.");
  const rows = [budgetRow("outbound bytes", bs.outbound_bytes, true), budgetRow("DNS queries", bs.dns_queries),
    budgetRow("DNS name bytes", bs.dns_name_bytes, true)];
  for (const [rule, rb] of Object.entries(bs.rules || {})) {
    rows.push(budgetRow(`rule ${rule} requests`, rb.requests), budgetRow(`rule ${rule} bytes`, rb.bytes, true));
  }
  const set = rows.filter(Boolean);
  return el("div", null, el("h3", null, "Budgets"), set.length ? table([
    {key: "name", label: "Budget"}, {key: "used", label: "Used", render: (r) => amount(r.used, r.bytes)},
    {key: "limit", label: "Limit", render: (r) => amount(r.limit, r.bytes)},
    {key: "left", label: "Left", render: (r) => amount(r.left, r.bytes)},
    {key: "meter", label: "Share used", render: (r) => r.meter},
  ], set, {testid: "budget-table"}) : notice("info", "The policy sets no budgets."));
}

function revokeControl(id, detail) {
  const box = el("div", {class: "danger"});
  const revoke = el("button", {type: "button", id: "revoke", class: "danger"}, "Revoke");
  const confirm = el("button", {type: "button", id: "revoke-confirm", class: "danger", hidden: true},
    "Confirm: revoke and close its connections");
  const msg = el("span", {id: "revoke-status"});
  revoke.addEventListener("click", () => { confirm.hidden = false; revoke.disabled = true; });
  confirm.addEventListener("click", async () => {
    confirm.disabled = true;
    try {
      await api.del(`sandboxes/${api.seg(id)}`);
      await showDetail(id, detail);
      detail.append(notice("ok", "Revoked."));
    } catch (err) {
      clear(msg, notice("error", err.message));
      confirm.disabled = false;
    }
  });
  box.append(revoke, confirm, msg);
  return box;
}
