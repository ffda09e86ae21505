// Drawing the ring: peers on a circle in ring order (the coordinator on top), each hop an arrow
// labelled with its RTT and path, and a bar of the model's layers coloured by holder. SVG built
// with Swarm.el: every label is a text node.
"use strict";

const Ring = (() => {
  const { el, short, num } = Swarm;
  const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"];

  function colorOf(view) {
    const map = {};
    view.ring.forEach((r, i) => { map[r.peer] = COLORS[i % COLORS.length]; });
    return map;
  }

  // view: the node's build_view (peer rows in ring order; the coordinator first when it holds no layers)
  function draw(host, view) {
    host.replaceChildren();
    if (!view || !view.ring.length) {
      host.appendChild(el("p", { class: "empty", text: "no ring is serving yet" }));
      return;
    }
    const W = 560, H = 450, cx = W / 2, cy = H / 2 + 8, R = 145;
    const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, class: "ring-svg", role: "img" });
    svg.appendChild(el("svg:defs", {},
      el("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
        el("svg:path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#888" }))));
    const rows = view.ring;
    const colors = colorOf(view);
    const pos = rows.map((_, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / rows.length;
      return [cx + R * Math.cos(a), cy + R * Math.sin(a)];
    });
    const index = {};
    rows.forEach((r, i) => { index[r.peer] = i; });
    // hops: each row to its next, bent outwards so that a two-peer ring shows both directions
    rows.forEach((r, i) => {
      if (!r.next || index[r.next] === undefined || r.next === r.peer) return;
      const [x1, y1] = pos[i], [x2, y2] = pos[index[r.next]];
      const dx = x2 - x1, dy = y2 - y1, len = Math.hypot(dx, dy) || 1;
      const nx = dy / len, ny = -dx / len; // the left of the direction of travel
      const bend = rows.length === 2 ? 60 : 22;
      const qx = (x1 + x2) / 2 + nx * bend, qy = (y1 + y2) / 2 + ny * bend;
      const trim = (ax, ay, bx, by) => { const l = Math.hypot(bx - ax, by - ay) || 1; return [ax + ((bx - ax) * 34) / l, ay + ((by - ay) * 34) / l]; };
      const [sx, sy] = trim(x1, y1, qx, qy), [ex, ey] = trim(x2, y2, qx, qy);
      svg.appendChild(el("svg:path", { d: `M ${sx} ${sy} Q ${qx} ${qy} ${ex} ${ey}`, fill: "none",
        class: "hop hop-" + pathKind(r.hop_path), "marker-end": "url(#arrow)" }));
      const lx = (x1 + x2) / 4 + qx / 2 + nx * 12, ly = (y1 + y2) / 4 + qy / 2 + ny * 12;
      const anchor = Math.abs(nx) < 0.3 ? "middle" : nx > 0 ? "start" : "end";
      svg.appendChild(el("svg:text", { x: lx, y: ly, class: "hop-label", "text-anchor": anchor },
        el("svg:tspan", { x: lx, dy: 0, text: num(r.rtt_next_ms, 1, " ms") }),
        el("svg:tspan", { x: lx, dy: 13, class: "hop-path", text: r.hop_path || "?" })));
    });
    rows.forEach((r, i) => {
      const [x, y] = pos[i];
      const g = el("svg:g", { class: "peer", "data-peer": r.peer, "data-role": r.role });
      g.appendChild(el("svg:circle", { cx: x, cy: y, r: 30, fill: r.block ? colors[r.peer] : "#ddd",
        class: r.role.startsWith("coordinator") ? "coord" : "" }));
      g.appendChild(el("svg:text", { x, y: y - 2, "text-anchor": "middle", class: "peer-id", text: "…" + r.peer.slice(-5) }));
      g.appendChild(el("svg:text", { x, y: y + 12, "text-anchor": "middle", class: "peer-block",
        text: r.block ? `[${r.block[0]}, ${r.block[1]})` : "head" }));
      const below = y >= cy ? 48 : -52; // role and device outside the circle, clear of the arrows
      g.appendChild(el("svg:text", { x, y: y + below, "text-anchor": "middle", class: "peer-role",
        text: r.role + (r.role.startsWith("coordinator") ? " ★" : "") }));
      g.appendChild(el("svg:text", { x, y: y + below + 13, "text-anchor": "middle", class: "peer-device",
        text: clip(r.device || "-", 40) }));
      g.appendChild(el("svg:title", { text: `${r.peer}\n${r.device || ""}` }));
      svg.appendChild(g);
    });
    host.appendChild(svg);
  }

  function pathKind(p) {
    p = String(p || "");
    if (p.startsWith("relay")) return "relayed";
    if (p.startsWith("hole")) return "punched";
    if (p === "self") return "self";
    return "direct";
  }

  function clip(s, n) { s = String(s); return s.length > n ? s.slice(0, n - 1) + "…" : s; }

  // The model's layers as one bar, each block in its holder's colour.
  function layers(host, view, nLayers) {
    host.replaceChildren();
    if (!view || !nLayers) return;
    const colors = colorOf(view);
    const bar = el("div", { class: "layer-bar" });
    for (const r of view.ring) {
      if (!r.block) continue;
      const [s, e] = r.block;
      bar.appendChild(el("div", { class: "block", "data-peer": r.peer, "data-start": s, "data-end": e,
        style: `left:${(100 * s) / nLayers}%;width:${(100 * (e - s)) / nLayers}%;background:${colors[r.peer]}`,
        title: `${r.peer}: layers ${s}–${e - 1}` }, el("span", { text: `${short(r.peer)} ${s}–${e - 1}` })));
    }
    host.appendChild(bar);
    host.appendChild(el("div", { class: "layer-scale" }, el("span", { text: "layer 0" }), el("span", { text: `${nLayers} layers` })));
  }

  // Where a traversal's time goes: a stacked bar of hops and stages (the plan's prediction).
  function split(host, sp, view) {
    host.replaceChildren();
    if (!sp || !sp.parts.length) return;
    const colors = colorOf(view);
    const known = sp.parts.filter((p) => p.ms !== null && p.ms !== undefined);
    const total = known.reduce((a, p) => a + p.ms, 0) || 1;
    const bar = el("div", { class: "split-bar" });
    for (const p of known) {
      const label = p.kind === "hop" ? `hop ${short(p.from)}→${short(p.to)}` : `compute ${short(p.peer)}`;
      bar.appendChild(el("div", { class: "part " + p.kind, title: `${label}: ${num(p.ms, 2, " ms")}`,
        style: `width:${(100 * p.ms) / total}%;` + (p.kind === "compute" ? `background:${colors[p.peer] || "#999"}` : "") },
        el("span", { text: `${label} ${num(p.ms, 1)}` })));
    }
    host.appendChild(bar);
    host.appendChild(el("p", { class: "note", text:
      `predicted ${num(sp.predicted_ms, 1, " ms")} per traversal · measured ${num(sp.measured_ms, 1, " ms")} (median, last generation) · ${sp.how}` }));
  }

  // A receipt (shard-swarm generate/run --receipt, or the API's) -> the same view the node sends.
  function receiptView(rc) {
    if (!rc || typeof rc !== "object" || !Array.isArray(rc.peers) || !rc.coordinator) {
      throw new Error("not a shard-swarm receipt: it needs peers, coordinator and ring");
    }
    const byId = {};
    for (const p of rc.peers) byId[p.id] = p;
    const ring = Array.isArray(rc.ring) ? rc.ring : [];
    const coord = rc.coordinator;
    const hopsList = Array.isArray(rc.hops) ? rc.hops : [];
    const pathOf = (a, b) => { const h = hopsList.find((x) => x.from === a && x.to === b); return h ? h.path : null; };
    const rtt = rc.rtt_ms || {};
    const rttOf = (a, b) => { const v = (rtt[a] || {})[b] ?? (rtt[b] || {})[a]; return v === undefined ? null : v; };
    const seq = [coord, ...ring, coord];
    const rows = [];
    const row = (id, role, next) => {
      const p = byId[id] || {};
      const block = Array.isArray(p.block) ? p.block : null;
      return { peer: id, role, block, layers: block ? block[1] - block[0] : 0, device: p.device || null,
        memory_used_gb: null, memory_offered_gb: p.memory_bytes ? p.memory_bytes / 1e9 : null,
        ms_per_layer: p.ms_per_layer ?? null, next, rtt_next_ms: next ? rttOf(id, next) : null,
        heartbeat_age_s: null, path: null, hop_path: next ? pathOf(id, next) : null };
    };
    if (!ring.includes(coord)) rows.push(row(coord, "coordinator", seq[1]));
    ring.forEach((p, i) => rows.push(row(p, p === coord ? "coordinator+stage" : "stage", seq[i + 2])));
    const nLayers = Math.max(0, ...rows.filter((r) => r.block).map((r) => r.block[1]));
    return { view: { ring: rows, coordinator: coord, epoch: rc.epoch, hops: hopsList }, nLayers };
  }

  return { draw, layers, split, receiptView };
})();
