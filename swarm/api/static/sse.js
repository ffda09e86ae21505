// The console's plumbing: the API token, and server-sent events read with fetch (an EventSource
// cannot send the Authorization header). Every string from the swarm is shown with textContent.
"use strict";

const Swarm = (() => {
  const KEY = "shard-swarm-api-token";

  function takeTokenFromHash() {
    // http://host:port/#token=... : the fragment never reaches the server or its logs
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const t = sessionStorage.getItem(KEY);
    if (t) h["Authorization"] = "Bearer " + t;
    return h;
  }

  // A tiny element builder: strings become text nodes, never markup.
  function el(tag, attrs, ...children) {
    const svg = tag.startsWith("svg:");
    const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
                     : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = String(v);
      else if (k === "style") node.style.cssText = String(v); // CSSOM: allowed by the page's CSP
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }

  function askToken(why) {
    const box = document.getElementById("token-box");
    if (!box) return;
    box.hidden = false;
    box.querySelector(".why").textContent = why;
  }

  function setupTokenBox(onSet) {
    const box = document.getElementById("token-box");
    if (!box) return;
    box.querySelector("form").addEventListener("submit", (e) => {
      e.preventDefault();
      const input = box.querySelector("input");
      sessionStorage.setItem(KEY, input.value.trim());
      input.value = "";
      box.hidden = true;
      onSet();
    });
  }

  // Read an event stream: calls onData(obj) for each JSON data line, onComment(text) for each
  // ": comment" line. Resolves when the stream ends; rejects with {status, body} on an HTTP error.
  async function readEvents(response, onData, onComment) {
    const reader = response.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          else if (line.startsWith(":") && onComment) onComment(line.slice(1).trim());
        }
        if (!data.length) continue;
        const text = data.join("\n");
        if (text === "[DONE]") { onData(null); continue; }
        let obj;
        try { obj = JSON.parse(text); } catch (err) { console.warn("bad event", err); continue; }
        onData(obj);
      }
    }
  }

  // Follow a GET event stream for ever, reconnecting after a pause; onState(connected, why).
  function follow(path, onData, onState) {
    let stopped = false;
    (async () => {
      while (!stopped) {
        let why = "";
        try {
          const r = await fetch(path, { headers: headers(), cache: "no-store" });
          if (r.status === 401) {
            why = "this node's API needs its token";
            askToken(why);
          } else if (!r.ok) {
            why = "HTTP " + r.status;
          } else {
            onState(true, "");
            await readEvents(r, onData);
            why = "the feed ended";
          }
        } catch (err) {
          why = "the node does not answer";
        }
        onState(false, why);
        await new Promise((res) => setTimeout(res, 2000));
      }
    })();
    return () => { stopped = true; };
  }

  const short = (id) => (id ? (id.length > 12 ? id.slice(0, 6) + "…" + id.slice(-4) : id) : "-");
  const num = (v, digits, unit) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits) + (unit || ""));
  const clock = (unix) => new Date(unix * 1000).toLocaleTimeString([], { hour12: false });

  takeTokenFromHash();
  return { headers, el, follow, readEvents, askToken, setupTokenBox, short, num, clock };
})();
