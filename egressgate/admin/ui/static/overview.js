// Overview: denies by reason over time (stacked bars) and the top denied hosts, drawn as SVG with
// createElementNS; every label (reason codes, host names: attacker-chosen) is a text node.

import * as api from "./api.js";
import {clear, el, fmtTime, notice, svg} from "./dom.js";

const RANGES = [
  {label: "last hour", seconds: 3600, bucket: 60},
  {label: "last 6 hours", seconds: 6 * 3600, bucket: 300},
  {label: "last 24 hours", seconds: 86400, bucket: 1800},
  {label: "last 7 days", seconds: 7 * 86400, bucket: 6 * 3600},
];
const COLORS = 8;  // .c0 .. .c7 in app.css

export function render(root) {
  const select = el("select", {id: "overview-range", name: "range"},
    RANGES.map((r, i) => el("option", {value: String(i)}, r.label)));
  const refresh = el("button", {type: "button", id: "overview-refresh"}, "Refresh");
  const out = el("div", {id: "overview-charts"});
  root.append(el("h1", null, "Overview"), el("div", {class: "filters"}, select, refresh), out);
  const load = async () => {
    const range = RANGES[Number(select.value)] || RANGES[0];
    const until = Math.floor(Date.now() / 1000);
    clear(out, notice("info", "loading…"));
    try {
      const data = await api.get(`stats${api.query({since: until - range.seconds, until, bucket: range.bucket})}`);
      clear(out, deniesChart(data.buckets || []), topHosts(data.top_denied_hosts || []));
    } catch (err) {
      clear(out, notice("error", err.message));
    }
  };
  select.addEventListener("change", load);
  refresh.addEventListener("click", load);
  load();
  return null;
}

function deniesChart(buckets) {
  const reasons = [...new Set(buckets.flatMap((b) => Object.keys(b.by_reason || {})))].sort();
  const totals = buckets.map((b) => Object.values(b.by_reason || {}).reduce((a, n) => a + Number(n || 0), 0));
  const max = Math.max(1, ...totals);
  const W = 800, H = 240, PAD = 30;
  const band = buckets.length ? (W - PAD) / buckets.length : W;
  const chart = svg("svg", {viewBox: `0 0 ${W} ${H + 20}`, class: "chart", role: "img",
    "aria-label": "denies by reason over time", "data-testid": "denies-chart"});
  chart.append(svg("line", {x1: PAD, y1: H, x2: W, y2: H, class: "axis"}),
    svg("text", {x: 0, y: 12, class: "tick"}, String(max)), svg("text", {x: 0, y: H, class: "tick"}, "0"));
  buckets.forEach((b, i) => {
    let y = H;
    reasons.forEach((reason, ri) => {
      const n = Number((b.by_reason || {})[reason] || 0);
      if (!n) return;
      const h = (n / max) * (H - 10);
      y -= h;
      chart.append(svg("rect", {x: PAD + i * band + 1, y, width: Math.max(1, band - 2), height: h,
        class: `bar c${ri % COLORS}`, "data-field": "bar"},
      svg("title", null, `${fmtTime(b.t)} ${reason}: ${n}`)));
    });
  });
  if (buckets.length) {
    chart.append(svg("text", {x: PAD, y: H + 16, class: "tick"}, fmtTime(buckets[0].t)),
      svg("text", {x: W, y: H + 16, class: "tick", "text-anchor": "end"}, fmtTime(buckets[buckets.length - 1].t)));
  }
  const legend = el("ul", {class: "legend"}, reasons.map((r, ri) =>
    el("li", null, el("span", {class: `swatch c${ri % COLORS}`}), el("span", {"data-field": "reason"}, r))));
  return el("figure", null, el("figcaption", null, "Denies by reason"),
    reasons.length ? [chart, legend] : notice("info", "No denies in this range."));
}

function topHosts(hosts) {
  const max = Math.max(1, ...hosts.map((h) => Number(h.count || 0)));
  const ROW = 22, W = 800, LABEL = 300;
  const chart = svg("svg", {viewBox: `0 0 ${W} ${Math.max(ROW, hosts.length * ROW)}`, class: "chart",
    role: "img", "aria-label": "top denied hosts", "data-testid": "hosts-chart"});
  hosts.forEach((h, i) => {
    const n = Number(h.count || 0);
    const y = i * ROW;
    chart.append(
      svg("text", {x: LABEL - 6, y: y + 15, class: "host", "text-anchor": "end", "data-field": "host"},
        String(h.host ?? "")),
      svg("rect", {x: LABEL, y: y + 3, width: Math.max(1, (n / max) * (W - LABEL - 60)), height: ROW - 6,
        class: "bar c0"}),
      svg("text", {x: LABEL + (n / max) * (W - LABEL - 60) + 4, y: y + 15, class: "tick"}, String(n)));
  });
  return el("figure", null, el("figcaption", null, "Top denied hosts"),
    hosts.length ? chart : notice("info", "No denied hosts in this range."));
}
