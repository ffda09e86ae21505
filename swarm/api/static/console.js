// The console page: the node's feed (/console/feed) drawn as the ring, speed, sessions and a
// timeline; and a receipt viewer that draws a saved run the same way.
"use strict";

(() => {
  const { el, short, num, clock } = Swarm;
  const $ = (id) => document.getElementById(id);
  const events = new Map(); // id -> event (a re-plan is sent again when its pause is known)

  function setConn(ok, why) {
    const c = $("conn");
    c.textContent = ok ? "live" : "offline: " + why;
    c.className = "pill " + (ok ? "on" : "off");
  }

  function numbers(host, items) {
    host.replaceChildren(...items.map(([label, value, id]) =>
      el("div", { class: "number", "data-k": id || null }, el("b", { text: value }), el("span", { text: label }))));
  }

  const bytes = (gb) => (gb === null || gb === undefined ? "-" : gb >= 1 ? num(gb, 2, " GB") : num(gb * 1000, 1, " MB"));

  function peersTable(view) {
    const body = $("peers").querySelector("tbody");
    body.replaceChildren(...[...view.ring, ...view.others].map((r, i) => el("tr", { "data-peer": r.peer },
      el("td", { text: i < view.ring.length ? String(i) : "" }),
      el("td", { class: "mono", title: r.peer, text: short(r.peer) }),
      el("td", { text: r.role }),
      el("td", { text: r.block ? `[${r.block[0]}, ${r.block[1]})` : "-" }),
      el("td", { class: "device", text: r.device || "-" }),
      el("td", { text: `${bytes(r.memory_used_gb)} / ${bytes(r.memory_offered_gb)}` }),
      el("td", { text: num(r.ms_per_layer, 2) }),
      el("td", { text: num(r.rtt_next_ms, 1, " ms") }),
      el("td", { text: r.hop_path || "-" }),
      el("td", { text: num(r.heartbeat_age_s, 1, " s") }))));
  }

  function history(host, runs) {
    host.replaceChildren();
    const pts = runs.filter((r) => r.tokens_per_s !== null && r.tokens_per_s !== undefined);
    if (!pts.length) { host.appendChild(el("p", { class: "empty", text: "no generation yet" })); return; }
    const W = 360, H = 110, P = 22;
    const maxY = Math.max(...pts.map((r) => r.tokens_per_s), 1);
    const x = (i) => P + (pts.length === 1 ? (W - 2 * P) / 2 : ((W - 2 * P) * i) / (pts.length - 1));
    const y = (v) => H - P - ((H - 2 * P) * v) / maxY;
    const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, class: "chart" });
    svg.appendChild(el("svg:line", { x1: P, y1: H - P, x2: W - P, y2: H - P, class: "axis" }));
    svg.appendChild(el("svg:text", { x: 2, y: P - 6, class: "axis-label", text: `${num(maxY, 1)} tok/s` }));
    svg.appendChild(el("svg:text", { x: W - P, y: H - 4, "text-anchor": "end", class: "axis-label",
      text: `last ${pts.length} generations` }));
    svg.appendChild(el("svg:polyline", { class: "line", points: pts.map((r, i) => `${x(i)},${y(r.tokens_per_s)}`).join(" ") }));
    pts.forEach((r, i) => svg.appendChild(el("svg:circle", { cx: x(i), cy: y(r.tokens_per_s), r: 2.5, class: "dot" },
      el("svg:title", { text: `${num(r.tokens_per_s, 1)} tok/s, ${num(r.accepted_per_traversal, 2)} per traversal, ` +
        `${num(r.traversal_ms, 1)} ms per traversal, ${r.tokens} tokens, epoch ${r.epoch}` }))));
    host.appendChild(svg);
  }

  function onState(st) {
    const stale = $("stale");
    stale.hidden = !st.stale;
    stale.textContent = st.error || "";
    if (!st.view) return;
    const v = st.view;
    $("epoch").textContent = `epoch ${v.epoch ?? "-"} · ${v.serving ? "serving" : "not serving"}`;
    $("cause").textContent = st.cause ? "planned because: " + st.cause : "";
    Ring.draw($("ring"), v);
    Ring.layers($("layers"), v, st.n_layers);
    Ring.split($("split"), st.split, v);
    peersTable(v);
    const s = st.sessions || {};
    numbers($("sessions"), [["generations running", `${s.active ?? "-"} / ${s.capacity ?? "-"}`, "active"],
      ["waiting in the queue", String(s.queued ?? "-"), "queued"], ["members", String(st.members ?? "-"), "members"]]);
    const last = (st.runs || []).slice(-1)[0] || {};
    numbers($("speed"), [["tok/s (recent median)", num(v.tokens_per_s, 1), "tps"],
      ["tokens accepted per traversal", num(v.accepted_per_traversal, 2), "apt"],
      ["ms per traversal (measured)", num(st.traversal_ms, 1), "trav"],
      ["tok/s, last generation", num(last.tokens_per_s, 1), "last"],
      ["ms of hops per traversal (RTTs)", num(v.ring_rtt_ms, 1), "rtt"]]);
    history($("history"), st.runs || []);
  }

  function eventItem(ev) {
    const peer = ev.peer ? el("span", { class: "mono", title: ev.peer, text: short(ev.peer) + " " }) : null;
    const parts = [el("time", { text: clock(ev.t) }), el("span", { class: "kind", text: ev.kind }), peer, el("span", { text: ev.text })];
    if (ev.kind === "replan") {
      if (ev.reason) parts.push(el("div", { class: "detail", text: "why it ended: " + ev.reason }));
      if (ev.cause && ev.cause !== ev.reason) parts.push(el("div", { class: "detail", text: "re-planned: " + ev.cause }));
      let pause = ev.pause_s === null || ev.pause_s === undefined
        ? "waiting for the next plan…" : `epoch ${ev.next_epoch} planned after ${num(ev.pause_s, 2, " s")}`;
      pause += ev.serving_after_s === null || ev.serving_after_s === undefined
        ? "" : ` · serving again after ${num(ev.serving_after_s, 1, " s")}`;
      parts.push(el("div", { class: "detail pause", text: pause }));
    }
    if (ev.kind === "ring") {
      parts.push(el("div", { class: "detail", text: `coordinator ${short(ev.coordinator)} · ring ${(ev.ring || []).map(short).join(" → ")}` +
        (ev.cause ? ` · ${ev.cause}` : "") }));
    }
    return el("li", { class: "event " + ev.kind, "data-id": ev.id }, ...parts);
  }

  function onEvent(ev) {
    events.set(ev.id, ev);
    const items = [...events.values()].sort((a, b) => b.t - a.t || b.seq - a.seq).slice(0, 100);
    $("timeline").replaceChildren(...items.map(eventItem));
  }

  function onData(msg) {
    if (!msg) return;
    if (msg.type === "hello") $("model").textContent = msg.model;
    else if (msg.type === "state") onState(msg);
    else if (msg.type === "event") onEvent(msg);
  }

  // -- the receipt viewer
  function showReceipt(rc) {
    const { view, nLayers } = Ring.receiptView(rc);
    $("receipt").hidden = false;
    numbers($("receipt-summary"), [
      ["output sha256", String(rc.output_sha256 || "-"), "sha"],
      ["tokens", String((rc.output_token_ids || []).length), "tokens"],
      ["tok/s", num(rc.tokens_per_s, 1), "tps"],
      ["tokens accepted per traversal", num(rc.accepted_per_traversal, 2), "apt"],
      ["ms per traversal (median)", num(rc.traversal_ms, 1), "trav"],
      ["epoch", String(rc.epoch ?? "-"), "epoch"], ["model", String((rc.model || {}).name || "-"), "model"]]);
    Ring.draw($("receipt-ring"), view);
    Ring.layers($("receipt-layers"), view, nLayers);
    $("receipt-replans").replaceChildren(...(rc.replans || []).map((r) => el("li", {
      text: `epoch ${r.from_epoch} → ${r.to_epoch}: ${r.cause || r.reason || ""} (pause ${num(r.pause_s, 2, " s")}, ` +
        `${r.layers_moved ?? "-"} layers moved)` })));
    if (!(rc.replans || []).length) $("receipt-replans").appendChild(el("li", { text: "none" }));
  }

  $("receipt-file").addEventListener("change", async (e) => {
    const f = e.target.files[0];
    $("receipt-error").textContent = "";
    if (!f) return;
    try {
      showReceipt(JSON.parse(await f.text()));
    } catch (err) {
      $("receipt").hidden = true;
      $("receipt-error").textContent = `${f.name}: ${err.message}`;
    }
  });

  Swarm.setupTokenBox(() => {});
  Swarm.follow("/console/feed", onData, setConn);
})();
