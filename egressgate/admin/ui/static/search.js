// Audit search over the server's index: by request id, request hash, sandbox, host, reason and time
// range. Each hit shows the record read back from the JSONL file (the record of truth), where it is
// (file, line, chain position) and whether its chain link verified.

import * as api from "./api.js";
import {clear, el, field, fmtBytes, formValues, notice, timeCell, val} from "./dom.js";
import {decision} from "./live.js";

const TEXT_FIELDS = [["Request id", "request_id"], ["Request hash", "request_hash"], ["Sandbox", "sandbox"],
  ["Host", "host"], ["Reason", "reason"]];

/** datetime-local (UTC, as the console shows times) -> unix seconds. */
function toSeconds(v) {
  if (!v) return undefined;
  const ms = Date.parse(`${v}Z`);
  return Number.isFinite(ms) ? Math.floor(ms / 1000) : undefined;
}

export function render(root) {
  const form = el("form", {class: "filters wrap", id: "search-form"},
    TEXT_FIELDS.map(([label, name]) => field(label, name)),
    field("Since (UTC)", "since", {type: "datetime-local"}),
    field("Until (UTC)", "until", {type: "datetime-local"}),
    field("Limit", "limit", {type: "number", value: "50", min: 1, max: 1000}),
    el("button", {type: "submit", id: "search-submit"}, "Search"));
  const out = el("div", {id: "search-results"});
  root.append(el("h1", null, "Audit search"), form, out);
  let params = {};
  const run = async (before) => {
    try {
      const data = await api.get(`search${api.query({...params, before})}`);
      const hits = Array.isArray(data) ? data : Array.isArray(data.hits) ? data.hits : [];
      const more = data && data.next_before ? el("button", {type: "button", id: "search-older"}, "Older") : null;
      if (!before) clear(out, el("p", {id: "search-count"}, `${hits.length} record${hits.length === 1 ? "" : "s"}`));
      out.querySelector("#search-older")?.remove();
      out.append(...hits.map(hitCard));
      if (more) {
        more.addEventListener("click", () => run(data.next_before));
        out.append(more);
      }
    } catch (err) {
      clear(out, notice("error", err.message));
    }
  };
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = formValues(form);
    params = {...v, since: toSeconds(v.since), until: toSeconds(v.until)};
    clear(out, notice("info", "searching…"));
    run(undefined);
  });
  // #/search?request_hash=... (from a Live row): fill the form from the route and search at once
  const at = location.hash.indexOf("?");
  if (at >= 0) {
    const given = new URLSearchParams(location.hash.slice(at + 1));
    let any = false;
    for (const [, name] of TEXT_FIELDS) {
      const value = given.get(name);
      if (value) { form.querySelector(`[name=${name}]`).value = value; any = true; }
    }
    if (any) form.requestSubmit();
  }
  return null;
}

/** An OTLP AnyValue as plain data (strings stay strings: shown with textContent like everything else). */
function anyValue(v) {
  if (!v || typeof v !== "object") return v;
  if ("stringValue" in v) return v.stringValue;
  if ("intValue" in v) return v.intValue;
  if ("doubleValue" in v) return v.doubleValue;
  if ("boolValue" in v) return v.boolValue;
  if ("bytesValue" in v) return v.bytesValue;
  if (v.arrayValue) return (v.arrayValue.values || []).map(anyValue);
  if (v.kvlistValue) return Object.fromEntries((v.kvlistValue.values || []).map((kv) => [kv.key, anyValue(kv.value)]));
  return v;
}

/** The attributes of the record's log record (one per audit line), in file order. */
function attributes(record) {
  const lr = record?.resourceLogs?.[0]?.scopeLogs?.[0]?.logRecords?.[0];
  if (!lr || !Array.isArray(lr.attributes)) return [];
  return lr.attributes.filter((a) => a && typeof a.key === "string").map((a) => [a.key, anyValue(a.value)]);
}

/** An attribute's value in its unit: byte counts as KiB/MiB and instants as UTC times (the raw value in the
 * title); everything else exactly as recorded. */
function attrValue(key, v) {
  if (typeof v === "number" || (typeof v === "string" && /^\d+$/.test(v))) {
    if (/(^|[._])bytes($|[._])/.test(key)) return fmtBytes(v, "attr");
    if (/(_at|[._]time|_ns)$/.test(key)) return timeCell(v, "attr");
  }
  return val(v, "attr");
}

/** One hit: a one-line summary (what, who, decision, where it is in the trail); every attribute and the
 * record as written are one click away instead of a 30-row list per hit. */
function hitCard(hit) {
  const verified = hit.verified === true;
  const attrs = attributes(hit.record);
  const a = Object.fromEntries(attrs);
  const target = a["egressgate.target.as_sent"] ?? a["egressgate.target.canonical"];
  return el("article", {class: "hit", "data-testid": "hit"},
    el("header", null,
      el("div", null,
        el("span", {class: `badge ${verified ? "ok" : "bad"}`, "data-field": "verified"},
          verified ? "chain verified" : "NOT verified"), " ",
        hit.time_ns ? [timeCell(hit.time_ns, "time"), " · "] : null,
        hit.kind ? [val(hit.kind, "kind"), " · "] : null,
        decision(a["egressgate.decision"] ?? null, a["egressgate.approval.action"]),
        a["egressgate.reason"] ? [" ", val(a["egressgate.reason"], "reason")] : null),
      el("div", {class: "summary"},
        a["egressgate.sandbox.id"] ? ["sandbox ", val(a["egressgate.sandbox.id"], "sandbox"), " · "] : null,
        target !== undefined && target !== null ? [val(target, "target"), " · "] : null,
        "chain position ", val(hit.chain_index, "chain_index"),
        " · ", val(hit.file, "file"), ":", val(hit.line, "line"))),
    hit.problem ? notice("error", hit.problem) : null,
    attrs.length ? el("details", {class: "attrs"}, el("summary", null, `${attrs.length} attributes`),
      el("dl", {class: "facts"}, attrs.map(([k, v]) => [el("dt", null, k), el("dd", null, attrValue(k, v))])))
      : null,
    el("details", null, el("summary", null, "Record as written (OTLP JSON)"),
      el("pre", {class: "record", "data-field": "record"}, JSON.stringify(hit.record, null, 2))));
}
