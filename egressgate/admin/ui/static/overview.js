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
  const select = el("select", {id: "overview-range", name: "range", "aria-label": "time range"},
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
      clear(out, deniesChart(data.buckets || [], range.bucket), topHosts(data.top_denied_hosts || []));
    } catch (err) {
      clear(out, notice("error", err.message));
    }
  };
  select.addEventListener("change", load);
  refresh.addEventListener("click", load);
  load();
  return null;
}

/** A round, even axis maximum at or above `n` (2, 4, 6, 10 × 10^k): its half is a whole count too. */
function niceMax(n) {
  const p = 10 ** Math.floor(Math.log10(Math.max(1, n)));
  return [2, 4, 6, 10, 20].map((m) => m * p).find((v) => v >= n);
}

/** "1 min", "30 min", "6 h": the width of one bar, for the y-axis title. */
function span(seconds) {
  return seconds % 3600 === 0 ? `${seconds / 3600} h` : `${Math.round(seconds / 60)} min`;
}

function deniesChart(buckets, bucketSeconds) {
  const reasons = [...new Set(buckets.flatMap((b) => Object.keys(b.by_reason || {})))].sort();
  const totals = buckets.map((b) => Object.values(b.by_reason || {}).reduce((a, n) => a + Number(n || 0), 0));
  const max = niceMax(Math.max(1, ...totals));
  const W = 800, H = 240, PAD = 56, TOP = 8;
  const band = buckets.length ? (W - PAD) / buckets.length : W;
  const chart = svg("svg", {viewBox: `0 0 ${W} ${H + 36}`, class: "chart", role: "img",
    "aria-label": `denies by reason over time, up to ${Math.max(0, ...totals)} per ${span(bucketSeconds)}`,
    "data-testid": "denies-chart"});
  const yOf = (v) => H - (v / max) * (H - TOP);
  // y axis: 0, half and max with grid lines, and what a bar's height counts
  for (const v of [0, max / 2, max]) {
    chart.append(svg("line", {x1: PAD, y1: yOf(v), x2: W, y2: yOf(v), class: v ? "grid-line" : "axis"}),
      svg("text", {x: PAD - 6, y: yOf(v) + 4, class: "tick", "text-anchor": "end", "data-field": "y-tick"},
        Number.isInteger(v) ? String(v) : v.toFixed(1)));
  }
  chart.append(svg("line", {x1: PAD, y1: TOP, x2: PAD, y2: H, class: "axis"}),
    svg("text", {x: 12, y: H / 2, class: "axis-title", "text-anchor": "middle", transform: `rotate(-90 12 ${H / 2})`,
      "data-field": "y-title"}, `denies per ${span(bucketSeconds)}`),
    svg("text", {x: PAD + (W - PAD) / 2, y: H + 32, class: "axis-title", "text-anchor": "middle",
      "data-field": "x-title"}, "time (UTC)"));
  buckets.forEach((b, i) => {
    let y = H;
    reasons.forEach((reason, ri) => {
      const n = Number((b.by_reason || {})[reason] || 0);
      if (!n) return;
      const h = (n / max) * (H - TOP);
      y -= h;
      chart.append(svg("rect", {x: PAD + i * band + 1, y, width: Math.max(1, band - 2), height: h,
        class: `bar c${ri % COLORS}`, "data-field": "bar"},
      svg("title", null, `${fmtTime(b.t)} ${reason}: ${n}`)));
    });
  });
  if (buckets.length) {  // x axis: first, middle and last bucket (date and time, to the minute)
    const at = (i) => fmtTime(buckets[i].t).slice(0, 16);
    const mid = Math.floor((buckets.length - 1) / 2);
    chart.append(svg("text", {x: PAD, y: H + 16, class: "tick", "data-field": "x-tick"}, at(0)),
      svg("text", {x: PAD + (mid + 0.5) * band, y: H + 16, class: "tick", "text-anchor": "middle",
        "data-field": "x-tick"}, at(mid)),
      svg("text", {x: W, y: H + 16, class: "tick", "text-anchor": "end", "data-field": "x-tick"},
        at(buckets.length - 1)));
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
