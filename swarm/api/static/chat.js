// The chat page: /v1/chat/completions streamed, with a stop button; under each answer its tokens
// per second and tokens accepted per traversal (the swarm's receipt, sent beside the usage).
"use strict";

(() => {
  const { el, num, headers } = Swarm;
  const $ = (id) => document.getElementById(id);
  const history = []; // {role, content}
  let model = null;
  let running = null; // AbortController of the answer in progress

  async function loadModel() {
    try {
      const r = await fetch("/v1/models", { headers: headers(), cache: "no-store" });
      if (r.status === 401) { Swarm.askToken("this node's API needs its token"); return; }
      const body = await r.json();
      model = body.data[0].id;
      $("model").textContent = model;
    } catch (err) {
      $("model").textContent = "the node does not answer";
    }
  }

  function bubble(role, text) {
    const content = el("div", { class: "content", text });
    const stats = el("div", { class: "stats" });
    const node = el("div", { class: "msg " + role }, el("div", { class: "who", text: role }), content, stats);
    $("messages").appendChild(node);
    node.scrollIntoView({ block: "end" });
    return { node, content, stats };
  }

  function setRunning(ctl) {
    running = ctl;
    $("send").disabled = !!ctl;
    $("stop").disabled = !ctl;
  }

  async function send(text) {
    if (!model) await loadModel();
    if (!model) return;
    history.push({ role: "user", content: text });
    bubble("user", text);
    const out = bubble("assistant", "");
    out.node.classList.add("streaming");
    const body = { model, messages: history.slice(), stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
    if ($("draft").value) body.draft = $("draft").value;
    const ctl = new AbortController();
    setRunning(ctl);
    const t0 = performance.now();
    let first = null, text_ = "", usage = null, swarm = null, finish = null, error = null;
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", signal: ctl.signal,
        headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
      if (!r.ok) {
        const e = await r.json().catch(() => ({}));
        if (r.status === 401) Swarm.askToken("this node's API needs its token");
        throw new Error((e.error && e.error.message) || "HTTP " + r.status);
      }
      await Swarm.readEvents(r, (obj) => {
        if (!obj) return;
        if (obj.error) { error = obj.error.message; return; }
        for (const c of obj.choices || []) {
          const piece = c.delta && c.delta.content;
          if (piece) {
            if (first === null) first = performance.now();
            text_ += piece;
            out.content.textContent = text_;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
        if (obj.usage) usage = obj.usage;
        if (obj.swarm) swarm = obj.swarm;
      }, (note) => out.node.appendChild(el("div", { class: "notice", text: note })));
    } catch (err) {
      if (err.name === "AbortError") finish = "stopped";
      else error = err.message;
    }
    setRunning(null);
    out.node.classList.remove("streaming");
    out.node.dataset.finish = finish || (error ? "error" : "");
    if (error) out.node.appendChild(el("div", { class: "error", text: error }));
    if (text_) history.push({ role: "assistant", content: text_ });
    const secs = (performance.now() - t0) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    const parts = [];
    if (swarm && swarm.tokens_per_s !== null) parts.push(`${num(swarm.tokens_per_s, 1)} tok/s on the swarm`);
    else if (tokens) parts.push(`${num(tokens / secs, 1)} tok/s here`);
    if (swarm) parts.push(`${num(swarm.accepted_per_traversal, 2)} tokens per traversal`);
    if (swarm && swarm.draft) parts.push(`draft ${swarm.draft}`);
    if (tokens !== null) parts.push(`${tokens} tokens`);
    parts.push(`${num(secs, 1)} s` + (first !== null ? ` (first token ${num((first - t0) / 1000, 2)} s)` : ""));
    if (finish) parts.push(finish === "length" ? "hit max tokens" : finish);
    out.stats.textContent = parts.join(" · ");
    if (swarm) {
      out.stats.dataset.tps = swarm.tokens_per_s ?? "";
      out.stats.dataset.apt = swarm.accepted_per_traversal ?? "";
      out.stats.title = "output sha256 " + (swarm.output_sha256 || "-");
    }
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (running) running.abort(); });
  $("clear").addEventListener("click", () => { if (!running) { history.length = 0; $("messages").replaceChildren(); } });
  Swarm.setupTokenBox(loadModel);
  loadModel();
})();
