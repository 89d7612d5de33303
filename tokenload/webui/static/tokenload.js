// tokenload's charts and run links under Locust's "tokenload" tab (Locust's extended tabs hold a table only).
// Drawn outside Locust's React tree, shown while the tab is open, refreshed from ./tokenload/stats.json.
(function () {
  "use strict";
  var EVERY_MS = 2000;
  var CHARTS = [
    { id: "ttft", title: "TTFT (ms)", lines: [["ttft_p50_s", "p50", 1000], ["ttft_p95_s", "p95", 1000]] },
    { id: "tpot", title: "TPOT (ms)", lines: [["tpot_p50_s", "p50", 1000], ["tpot_p95_s", "p95", 1000]] },
    { id: "tokens", title: "Output tokens/s", lines: [["output_tok_s", "tokens/s", 1]] }
  ];
  var COLORS = ["#1976d2", "#e65100"];
  var SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    var node = tag.indexOf("svg:") === 0 ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function tabOpen() {
    return new URLSearchParams(window.location.search).get("tab") === "tokenload";
  }

  var panel = el("section", { id: "tokenload-panel", style: "display:none;padding:16px 24px;font-family:sans-serif" });
  var runInfo = el("p", { id: "tokenload-run" });
  var serverInfo = el("p", { id: "tokenload-server" });
  var chartsBox = el("div", { style: "display:flex;flex-wrap:wrap;gap:16px" });
  var runsList = el("ul", { id: "tokenload-runs" });
  panel.appendChild(runInfo);
  panel.appendChild(serverInfo);
  panel.appendChild(chartsBox);
  panel.appendChild(el("h3", {}, "Runs (one per start)"));
  panel.appendChild(runsList);
  document.body.appendChild(panel);

  function chart(spec, series) {
    var w = 420, h = 200, pad = 40;
    var svg = el("svg:svg", { width: w, height: h, id: "tokenload-chart-" + spec.id, role: "img" });
    svg.appendChild(el("svg:text", { x: pad, y: 14, "font-size": 13 }, spec.title));
    var t = series.t || [];
    var max = 0;
    spec.lines.forEach(function (line) {
      (series[line[0]] || []).forEach(function (v) { if (v !== null) max = Math.max(max, v * line[2]); });
    });
    max = max || 1;
    var t0 = t.length ? t[0] : 0, span = t.length > 1 ? t[t.length - 1] - t0 : 1;
    svg.appendChild(el("svg:line", { x1: pad, y1: h - pad, x2: w - 10, y2: h - pad, stroke: "#888" }));
    svg.appendChild(el("svg:line", { x1: pad, y1: 20, x2: pad, y2: h - pad, stroke: "#888" }));
    svg.appendChild(el("svg:text", { x: 2, y: 28, "font-size": 10 }, max.toFixed(max < 10 ? 1 : 0)));
    svg.appendChild(el("svg:text", { x: w - 60, y: h - pad + 14, "font-size": 10 }, span.toFixed(0) + " s"));
    spec.lines.forEach(function (line, i) {
      var pts = [];
      (series[line[0]] || []).forEach(function (v, j) {
        if (v === null) return;
        var x = pad + (w - pad - 10) * (t[j] - t0) / (span || 1);
        var y = h - pad - (h - pad - 20) * (v * line[2]) / max;
        pts.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      svg.appendChild(el("svg:polyline", { points: pts.join(" "), fill: "none", stroke: COLORS[i], "stroke-width": 2 }));
      svg.appendChild(el("svg:text", { x: pad + 150 + 60 * i, y: 14, "font-size": 11, fill: COLORS[i] }, line[1]));
    });
    return svg;
  }

  function render(data) {
    var run = data.run, s = data.summary;
    runInfo.textContent = "Run " + run.number + " (" + run.run_id + ", " + run.state + ") in " + run.run_dir +
      ": " + s.requests + " requests, " + s.errors + " failures";
    runInfo.setAttribute("data-ttft-p50-s", s.ttft_p50_s === null ? "" : s.ttft_p50_s);
    runInfo.setAttribute("data-tpot-p50-s", s.tpot_p50_s === null ? "" : s.tpot_p50_s);
    var g = data.server;  // the inference server's own gauges from its /metrics, when it publishes them
    serverInfo.textContent = g ? "Server (its /metrics): " + ["running", "waiting"].filter(function (k) {
      return g[k] !== undefined;
    }).map(function (k) { return g[k] + " " + k; }).concat(g.kv_cache_usage === undefined ? [] :
      ["KV cache " + Math.round(100 * g.kv_cache_usage) + "%"]).join(" · ") : "";
    chartsBox.replaceChildren.apply(chartsBox, CHARTS.map(function (spec) { return chart(spec, data.series); }));
    runsList.replaceChildren.apply(runsList, data.runs.map(function (r) {
      var item = el("li", { "data-run": r.number, "data-state": r.state });
      item.appendChild(document.createTextNode("Run " + r.number + " · " + r.run_dir + " · " + r.state + " "));
      if (r.report) item.appendChild(el("a", { href: "./tokenload/runs/" + r.number + "/report.html", target: "_blank" }, "report.html"));
      if (r.detail) item.appendChild(el("small", {}, " " + r.detail));
      return item;
    }));
  }

  function place() {
    // Right under the tab's table when it is on the page (Locust's page fills the window: below it is far away).
    var table = document.querySelector("#root table");
    var box = table && (table.closest(".MuiTableContainer-root") || table.parentElement);
    var target = box || document.body.lastChild;
    if (target && target.nextSibling !== panel) target.after(panel);
  }

  function tick() {
    var open = tabOpen();
    panel.style.display = open ? "block" : "none";
    if (!open) return;
    place();
    fetch("./tokenload/stats.json").then(function (r) { return r.json(); }).then(render).catch(function () {});
  }

  window.addEventListener("popstate", tick);
  document.addEventListener("click", function () { setTimeout(tick, 50); });
  setInterval(tick, EVERY_MS);
  tick();
})();
