"use strict";
(function () {
  const T = JSON.parse(document.getElementById("trace-data").textContent);
  const steps = T.steps;
  const N = steps.length;
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const show = (s) => /^ +$/.test(s) ? "\u2423".repeat(s.length) :
    String(s).replace(/\n/g, "\u23CE").replace(/\t/g, "\u21E5") || "\u2205";
  const mb = (b) => b >= 1e9 ? (b / 1e9).toFixed(2) + " GB" : (b / 1e6).toFixed(2) + " MB";
  const ms = (s) => (s * 1e3).toFixed(2) + " ms";
  const PHASE_COLOR = {prefill: "#2e9d57", decode: "#2f6fd0", verify: "#8e44ad", mixed: "#d9822b"};
  const SEQ_COLOR = ["#2f6fd0", "#d9822b", "#8e44ad", "#2e9d57", "#c0392b", "#16a085", "#7f8c8d", "#b7950b"];
  const nseq = T.prompts.length;
  const paged = T.cache.layout === "paged";
  let cur = 0, timer = null, distPick = 0;

  // Each sequence's generated tokens with the step that sampled them.
  const gen = T.prompts.map(() => []);
  steps.forEach((st, i) => st.sequences.forEach((s) => s.sampled_text.forEach((t, j) =>
    gen[s.seq].push({text: t, id: s.sampled[j], step: i}))));

  // -- header and timeline ---------------------------------------------------------------------------
  const m = T.model, c = T.cache, mc = T.machine;
  $("title").textContent = "arlm trace \u2014 " + m.name;
  $("subtitle").textContent = `${m.n_layer} layers \u00B7 ${m.n_head} heads (${m.n_kv_heads} KV) of ${m.head_dim} \u00B7 ` +
    `d_model ${m.d_model} \u00B7 vocab ${m.vocab_size} \u00B7 weights ${m.quantization} \u00B7 KV cache ${c.layout}, ${c.dtype}, ` +
    `${c.bytes_per_token} B/token \u00B7 ${mc.cpu}, ${mc.threads || "?"} threads, ` +
    `${(mc.bandwidth / 1e9).toFixed(1)} GB/s memory, ${(mc.flops / 1e9).toFixed(0)} GFLOP/s float32 matmul (measured)` +
    (T.speculative ? ` \u00B7 speculative: ${T.speculative}` : "");
  $("timeline").innerHTML = steps.map((st, i) =>
    `<div class="tl ${st.phase}-bg" data-step="${i}" title="step ${i}: ${st.phase}, ${ms(st.seconds)}">${i}</div>`).join("");
  $("timeline").addEventListener("click", (e) => {
    const d = e.target.closest("[data-step]");
    if (d) go(+d.dataset.step);
  });

  // -- reference code ---------------------------------------------------------------------------------
  const CODE = [
    ["prefill", "ids = tokenizer.encode(prompt)          # [B, P]"],
    ["prefill", "cache = KVCache(L, B, H_kv, T, d_head)  # all slots unallocated"],
    ["prefill", "logits = model(ids, cache)              # prefill: P tokens, one pass;"],
    ["prefill", "                                        # K, V -> slots 0..P-1"],
    ["loop", "for step in range(max_new_tokens):"],
    ["sample", "    p = softmax(logits[:, -1] / temp)   # [B, vocab]"],
    ["sample", "    p = top_p(top_k(p, k), top_p)       # the cut"],
    ["sample", "    next_id = multinomial(p)            # [B, 1]"],
    ["finish", "    if next_id == eos: break"],
  ];
  if (T.speculative) {
    CODE.push(["verify", "    draft = drafter.propose(ids, k)     # k cheap guesses"]);
    CODE.push(["verify", "    logits = model(draft, cache)        # verify k + 1 in one pass,"]);
    CODE.push(["verify", "                                        # keep the agreeing prefix"]);
  }
  CODE.push(["decode", "    logits = model(next_id, cache)      # decode: 1 token, reads all"]);
  CODE.push(["decode", "                                        # weights + cached K/V once"]);
  $("code").innerHTML = CODE.map(([kind, text], i) =>
    `<span class="ln" data-kind="${kind}" data-line="${i + 1}"><span class="no">${i + 1}</span>${esc(text)}</span>`).join("");
  $("code").addEventListener("click", (e) => {
    const ln = e.target.closest(".ln");
    if (!ln) return;
    const kind = ln.dataset.kind;
    const find = (pred, from) => {
      for (let k = 0; k < N; k++) { const i = (from + k) % N; if (pred(steps[i])) return i; }
      return -1;
    };
    const has = (st, ph) => st.sequences.some((s) => s.phase === ph);
    let target = -1;
    if (kind === "prefill") target = find((st) => has(st, "prefill"), 0);
    else if (kind === "decode" || kind === "loop") target = find((st) => has(st, "decode"), kind === "loop" ? 0 : cur + 1);
    else if (kind === "verify") target = find((st) => has(st, "verify"), cur + 1);
    else if (kind === "sample") target = find((st) => st.sequences.some((s) => s.sampled.length), cur);
    else if (kind === "finish") target = find((st) => st.sequences.some((s) => s.finish_reason), 0);
    if (target >= 0) go(target);
  });

  function runsLines(st) {
    const kinds = new Set(st.sequences.map((s) => s.phase));
    const run = new Set(), run2 = new Set();
    if (kinds.has("prefill")) ["prefill"].forEach((k) => run.add(k));
    if (kinds.has("decode")) { run.add("decode"); run2.add("loop"); }
    if (kinds.has("verify")) { run.add("verify"); run2.add("loop"); }
    if (st.sequences.some((s) => s.sampled.length)) run2.add("sample");
    if (st.sequences.some((s) => s.finish_reason)) run2.add("finish");
    return [run, run2];
  }

  // -- panels ---------------------------------------------------------------------------------------------
  function renderStream(st) {
    const fed = {}, fresh = {};
    st.sequences.forEach((s) => { fed[s.seq] = s.positions; fresh[s.seq] = s.sampled.length; });
    let html = "";
    for (let q = 0; q < nseq; q++) {
      const p = T.prompts[q];
      const toks = p.tokens.map((t) => ({text: t, gen: false, step: -1})).concat(gen[q].map((g) => ({text: g.text, gen: true, step: g.step})));
      const range = fed[q];
      html += `<div class="seqlabel">sequence ${q}${T.outputs[q] && T.outputs[q].finish_reason ? " \u00B7 finish: " + esc(T.outputs[q].finish_reason) : ""}</div><div class="tokens">`;
      toks.forEach((t, i) => {
        const cls = ["tok"];
        if (t.gen) cls.push("gen");
        if (t.step > cur) cls.push("future");
        if (t.step === cur) cls.push("new");
        if (range && i >= range[0] && i < range[1]) cls.push("fed");
        html += `<span class="${cls.join(" ")}" title="position ${i}${t.gen ? ", sampled at step " + t.step : ", prompt"}">${esc(show(t.text))}</span>`;
      });
      html += "</div>";
    }
    $("stream").innerHTML = html;
  }

  // Blocks held by each sequence after step i (a finished sequence's are given back).
  function heldBlocks(i) {
    const held = {};
    for (let k = 0; k <= i; k++) steps[k].sequences.forEach((s) => { held[s.seq] = s.finish_reason ? null : s.blocks; });
    return held;
  }

  function renderKV(st) {
    const bs = c.block_size;
    let html = `<div class="note" style="margin-top:0">K_cache, V_cache <b>[${c.shape.join(", ")}]</b> ` +
      (paged ? "= [L, blocks, H_kv, block size, d_head]" : "= [L, B, H_kv, T, d_head]") +
      ` \u00B7 ${st.kv.tokens_cached} tokens cached \u00D7 ${st.kv.bytes_per_token} B = ${mb(st.kv.tokens_cached * st.kv.bytes_per_token)} of ${mb(st.kv.pool_bytes)}</div>`;
    st.sequences.forEach((s) => {
      const cap = paged ? s.blocks.length * bs : bs;
      const n = Math.max(cap, s.slots_written[1]);
      html += `<div class="seqlabel">sequence ${s.seq}: slots ${s.slots_written[0]}..${s.slots_written[1] - 1} written, ` +
        `${s.slots_occupied} of ${n} occupied` + (paged ? `, blocks [${s.blocks.join(", ")}]` : `, row ${s.blocks[0]}`) + `</div><div class="slots">`;
      for (let j = 0; j < n; j++) {
        const cls = j >= s.slots_written[0] && j < s.slots_written[1] ? "slot wr" : (j < s.slots_written[0] ? "slot occ" : "slot");
        const what = cls === "slot" ? "unallocated" : (cls === "slot wr" ? "written this step" : "cached");
        html += `<div class="${cls}" title="slot ${j} \u2014 ${what}"${paged && j % bs === 0 && j ? ' style="margin-left:5px"' : ""}></div>`;
      }
      html += "</div>";
    });
    if (paged) {
      const held = heldBlocks(cur), owner = {};
      Object.keys(held).forEach((q) => (held[q] || []).forEach((b) => { owner[b] = +q; }));
      html += `<div class="seqlabel">the pool: ${c.blocks} blocks of ${bs} slots, ${Object.keys(owner).length} held</div><div class="blockgrid">`;
      for (let b = 0; b < c.blocks; b++) {
        const q = owner[b];
        html += q === undefined ? `<div class="block" title="block ${b} \u2014 unallocated">${b}</div>` :
          `<div class="block held" style="background:${SEQ_COLOR[q % SEQ_COLOR.length]}" title="block ${b} \u2014 sequence ${q}">${b}</div>`;
      }
      html += "</div>";
    }
    $("kv").innerHTML = html;
  }

  function renderShapes(st) {
    const B = st.sequences.length, Tn = st.batch_shape[1], slots = Math.max(...st.sequences.map((s) => s.slots_written[1]));
    const samples = st.sequences.reduce((a, s) => a + s.distributions.length, 0);
    const what = st.phase === "prefill" ? "prompt" : (st.phase === "decode" ? "last sampled token" : "tokens");
    const rows = [
      [`input_ids`, `[${B}, ${Tn}]`, `${what}: ` + st.sequences.map((s) => `${s.shape[1]} token(s) of sequence ${s.seq}`).join(", "), true],
      [`x = embed(input_ids)`, `[${B}, ${Tn}, ${m.d_model}]`, "one d_model vector per token"],
      [`q`, `[${B}, ${m.n_head}, ${Tn}, ${m.head_dim}]`, `${m.n_head} query heads`],
      [`k, v (new)`, `[${B}, ${m.n_kv_heads}, ${Tn}, ${m.head_dim}]`, `written to the cache in each of ${m.n_layer} layers`, true],
      [`K_cache, V_cache`, `[${m.n_layer}, ${B}, ${m.n_kv_heads}, ${slots}, ${m.head_dim}]`, "the slots attended over, after the write", true],
      [`scores = q k\u1D40`, `[${B}, ${m.n_head}, ${Tn}, ${slots}]`, `${m.n_head / m.n_kv_heads} query heads share each KV head (GQA)`],
      [`logits`, `[${samples}, ${m.vocab_size}]`, "only the rows that sample (the last position of each sequence)"],
      [`next_id`, `[${samples}, 1]`, st.sequences.map((s) => s.sampled_text.map(show).join("")).filter((x) => x).map((x) => JSON.stringify(x)).join(", ")],
    ];
    $("shapes").innerHTML = rows.map(([name, shape, note, hot]) =>
      `<tr class="${hot ? "hot" : ""}"><td class="t">${esc(name)}</td><td class="t">${esc(shape)}</td><td>${esc(note)}</td></tr>`).join("");
  }

  function renderCode(st) {
    const [run, run2] = runsLines(st);
    document.querySelectorAll("#code .ln").forEach((ln) => {
      ln.classList.toggle("run", run.has(ln.dataset.kind));
      ln.classList.toggle("run2", !run.has(ln.dataset.kind) && run2.has(ln.dataset.kind));
    });
  }

  function renderDist(st) {
    const opts = [];
    st.sequences.forEach((s) => s.distributions.forEach((d, j) => opts.push({s, d, j})));
    if (!opts.length) { $("dist").innerHTML = '<div class="note">This step samples no token (a prefill chunk before the prompt\'s end).</div>'; return; }
    if (distPick >= opts.length) distPick = 0;
    const {s, d, j} = opts[distPick];
    const sp = T.sampling;
    let html = "";
    if (opts.length > 1) html += '<div class="tabs">' + opts.map((o, i) =>
      `<button data-pick="${i}" class="${i === distPick ? "on" : ""}">seq ${o.s.seq}${o.s.distributions.length > 1 ? " #" + (o.j + 1) : ""}</button>`).join("") + "</div>";
    const top = Math.max(...d.p, ...d.p_sampling);
    d.ids.forEach((id, i) => {
      const cls = ["row"];
      if (!d.kept[i]) cls.push("cut");
      if (id === d.sampled) cls.push("sampled");
      html += `<div class="${cls.join(" ")}" title="token ${id}: p = ${d.p[i].toFixed(4)}, after temperature and the cut ${d.p_sampling[i].toFixed(4)}">` +
        `<span class="name">${esc(show(d.text[i]))}</span><span class="track"><span class="p" style="width:${(d.p[i] / top * 100).toFixed(1)}%"></span>` +
        `<span class="ps" style="width:${(d.p_sampling[i] / top * 100).toFixed(1)}%"></span></span><span>${d.p[i].toFixed(3)}</span></div>`;
    });
    const inTop = d.ids.includes(d.sampled);
    html += `<div class="note">sampled: <b>${esc(JSON.stringify(d.sampled_text))}</b>${inTop ? "" : " (outside the top " + d.ids.length + ")"} \u00B7 ` +
      `light bars: the model's probabilities; dark: what sampling draws from after temperature ${sp.temperature}` +
      `${sp.top_k ? ", top-k " + sp.top_k : ""}${sp.top_p < 1 ? ", top-p " + sp.top_p : ""}${sp.min_p > 0 ? ", min-p " + sp.min_p : ""}` +
      ` (struck out: cut)${sp.temperature === 0 ? "; temperature 0 is greedy: the argmax alone" : ""}</div>`;
    $("dist").innerHTML = html;
  }
  $("dist").addEventListener("click", (e) => {
    const b = e.target.closest("[data-pick]");
    if (b) { distPick = +b.dataset.pick; render(); }
  });

  // -- the chart: time per step against the floors the machine sets ----------------------------------
  const W = 900, H = 230, L = 56, R = 10, TOP = 14, BOT = 34;
  function renderChart() {
    const pw = W - L - R, ph = H - TOP - BOT;
    const bw = mc.bandwidth || 1, peak = mc.flops || 1;
    const floors = steps.map((st) => ({mem: (st.bytes_weights + st.bytes_kv) / bw, cmp: st.flops / peak}));
    const ymax = Math.max(...steps.map((s) => s.seconds), ...floors.map((f) => Math.max(f.mem, f.cmp))) * 1.08 || 1;
    const x = (i) => L + i * pw / N, y = (v) => TOP + ph - v / ymax * ph, bwid = Math.max(1, pw / N - 2);
    let svg = `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="time per step"><rect x="${L}" y="${TOP}" width="${pw}" height="${ph}" fill="#fafafa" stroke="#ccc"/>`;
    for (let k = 0; k <= 4; k++) {
      const v = ymax * k / 4;
      svg += `<line x1="${L}" x2="${L + pw}" y1="${y(v)}" y2="${y(v)}" stroke="#eee"/><text x="${L - 5}" y="${y(v) + 4}" font-size="11" text-anchor="end">${(v * 1e3).toFixed(1)}</text>`;
    }
    svg += `<text x="12" y="${TOP + ph / 2}" font-size="11" transform="rotate(-90 12 ${TOP + ph / 2})" text-anchor="middle">ms per step</text>`;
    steps.forEach((st, i) => {
      svg += `<rect class="bar" data-step="${i}" x="${x(i) + 1}" y="${y(st.seconds)}" width="${bwid}" height="${ph - (y(st.seconds) - TOP)}" ` +
        `fill="${PHASE_COLOR[st.phase] || "#888"}" opacity="${i === cur ? 1 : 0.55}" stroke="${i === cur ? "#111" : "none"}" stroke-width="1.5">` +
        `<title>step ${i} (${st.phase}): ${ms(st.seconds)}; at the memory bandwidth ${ms(floors[i].mem)}, at the matmul peak ${ms(floors[i].cmp)}</title></rect>`;
      svg += `<line x1="${x(i)}" x2="${x(i) + bwid + 2}" y1="${y(floors[i].mem)}" y2="${y(floors[i].mem)}" stroke="#111" stroke-width="2"/>`;
      svg += `<line x1="${x(i)}" x2="${x(i) + bwid + 2}" y1="${y(floors[i].cmp)}" y2="${y(floors[i].cmp)}" stroke="#c0392b" stroke-width="2" stroke-dasharray="3 2"/>`;
    });
    const tick = Math.max(1, Math.ceil(N / 20));
    for (let i = 0; i < N; i += tick) svg += `<text x="${x(i) + bwid / 2 + 1}" y="${H - BOT + 14}" font-size="10" text-anchor="middle">${i}</text>`;
    svg += `<text x="${L + pw / 2}" y="${H - 4}" font-size="11" text-anchor="middle">step (bars: wall time; black: bytes read \u00F7 memory bandwidth; red dashed: FLOPs \u00F7 matmul peak)</text></svg>`;
    // Bytes read per step (weights, then cached K/V, stacked) and the bandwidth each step achieved,
    // against the machine's: decode's serial memory traffic next to prefill's one read for many tokens.
    const bmax = Math.max(...steps.map((s) => s.bytes_weights + s.bytes_kv)) * 1.08 || 1;
    const gmax = Math.max(bw, ...steps.map((s) => s.bandwidth)) * 1.1;
    const yb = (v) => TOP + ph - v / bmax * ph, yg = (v) => TOP + ph - v / gmax * ph;
    svg += `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="bytes per step"><rect x="${L}" y="${TOP}" width="${pw}" height="${ph}" fill="#fafafa" stroke="#ccc"/>`;
    for (let k = 0; k <= 4; k++) {
      const v = bmax * k / 4;
      svg += `<line x1="${L}" x2="${L + pw}" y1="${yb(v)}" y2="${yb(v)}" stroke="#eee"/><text x="${L - 5}" y="${yb(v) + 4}" font-size="11" text-anchor="end">${(v / 1e6).toFixed(0)}</text>`;
      const g = gmax * k / 4;
      svg += `<text x="${L + pw - 4}" y="${yg(g) + 4}" font-size="10" fill="#c0392b" text-anchor="end">${(g / 1e9).toFixed(0)} GB/s</text>`;
    }
    svg += `<text x="12" y="${TOP + ph / 2}" font-size="11" transform="rotate(-90 12 ${TOP + ph / 2})" text-anchor="middle">MB read</text>`;
    let line = "";
    steps.forEach((st, i) => {
      const op = i === cur ? 1 : 0.55;
      svg += `<rect class="bar" data-step="${i}" x="${x(i) + 1}" y="${yb(st.bytes_weights)}" width="${bwid}" height="${TOP + ph - yb(st.bytes_weights)}" fill="#7f8c8d" opacity="${op}"><title>step ${i}: ${mb(st.bytes_weights)} of weights</title></rect>`;
      svg += `<rect class="bar" data-step="${i}" x="${x(i) + 1}" y="${yb(st.bytes_weights + st.bytes_kv)}" width="${bwid}" height="${yb(st.bytes_weights) - yb(st.bytes_weights + st.bytes_kv)}" fill="#d9822b" opacity="${op}"><title>step ${i}: ${mb(st.bytes_kv)} of cached K/V</title></rect>`;
      line += `${i ? "L" : "M"}${x(i) + 1 + bwid / 2},${yg(st.bandwidth)}`;
    });
    svg += `<path d="${line}" fill="none" stroke="#c0392b" stroke-width="1.5"/>`;
    svg += `<line x1="${L}" x2="${L + pw}" y1="${yg(bw)}" y2="${yg(bw)}" stroke="#c0392b" stroke-width="2" stroke-dasharray="6 3"/>`;
    svg += `<text x="${L + 4}" y="${yg(bw) - 4}" font-size="11" fill="#c0392b">the machine's memory bandwidth, ${(bw / 1e9).toFixed(1)} GB/s</text>`;
    for (let i = 0; i < N; i += tick) svg += `<text x="${x(i) + bwid / 2 + 1}" y="${H - BOT + 14}" font-size="10" text-anchor="middle">${i}</text>`;
    svg += `<text x="${L + pw / 2}" y="${H - 4}" font-size="11" text-anchor="middle">step (grey: weights read; orange: cached K/V read; red line: GB/s achieved)</text></svg>`;
    $("chart").innerHTML = svg;
  }
  $("chart").addEventListener("click", (e) => {
    const b = e.target.closest("[data-step]");
    if (b) go(+b.dataset.step);
  });

  function renderNumbers(st) {
    const bytes = st.bytes_weights + st.bytes_kv;
    const gbs = bytes / st.seconds / 1e9, gfs = st.flops / st.seconds / 1e9;
    const memFloor = bytes / mc.bandwidth, cmpFloor = st.flops / mc.flops;
    const bound = memFloor >= cmpFloor ? "memory-bandwidth-bound: the bytes it must read set its floor" : "compute-bound: its FLOPs set its floor";
    const dec = steps.filter((s) => s.phase === "decode");
    const decMs = dec.length ? dec.reduce((a, s) => a + s.seconds, 0) / dec.length : 0;
    const decBytes = dec.length ? dec.reduce((a, s) => a + s.bytes_weights + s.bytes_kv, 0) / dec.length : 0;
    let html = `<p>Step ${cur} (${st.phase}, ${st.tokens} token(s) through the model) read <b>${mb(st.bytes_weights)}</b> of weights and ` +
      `<b>${mb(st.bytes_kv)}</b> of cached K/V in <b>${ms(st.seconds)}</b>: <b>${gbs.toFixed(1)} GB/s</b>, ` +
      `${(gbs * 1e9 / mc.bandwidth * 100).toFixed(0)}% of this machine's ${(mc.bandwidth / 1e9).toFixed(1)} GB/s; ` +
      `<b>${(st.flops / 1e9).toFixed(2)} GFLOP</b> at ${gfs.toFixed(0)} GFLOP/s, ${(gfs * 1e9 / mc.flops * 100).toFixed(0)}% of its float32 matmul peak. ` +
      `On the machine's ceilings it is ${bound} (${ms(memFloor)} for the bytes, ${ms(cmpFloor)} for the FLOPs).</p>`;
    if (dec.length) html += `<p>Decode is serial: each of the ${dec.length} decode steps here read ~${mb(decBytes)} (every weight, every cached K/V) ` +
      `to produce one token per sequence, ${ms(decMs)} a step. Generating 1,000 tokens takes 1,000 such rounds of memory reads ` +
      `(~${(decMs * 1000).toFixed(1)} s at this rate); a prefill reads the weights once for all of its prompt's tokens.</p>`;
    $("numbers").innerHTML = html;
  }

  function render() {
    const st = steps[cur];
    $("stepinfo").innerHTML = `step ${cur} / ${N - 1} <span class="badge ${st.phase}">${st.phase}</span> ` +
      `batch [${st.batch_shape.join(", ")}] \u00B7 ${ms(st.seconds)}`;
    document.querySelectorAll("#timeline .tl").forEach((d, i) => d.classList.toggle("cur", i === cur));
    renderStream(st); renderKV(st); renderShapes(st); renderCode(st); renderDist(st); renderChart(); renderNumbers(st);
    document.body.dataset.step = String(cur);
  }

  function go(i) {
    const next = Math.max(0, Math.min(N - 1, i));
    if (next !== cur) distPick = 0;
    cur = next;
    render();
  }
  function play() {
    if (timer) { clearInterval(timer); timer = null; $("play").innerHTML = "&#x25B6; play"; return; }
    if (cur >= N - 1) go(0);
    $("play").innerHTML = "&#x23F8; pause";
    timer = setInterval(() => { if (cur >= N - 1) play(); else go(cur + 1); }, 700);
  }
  $("first").onclick = () => go(0);
  $("prev").onclick = () => go(cur - 1);
  $("next").onclick = () => go(cur + 1);
  $("last").onclick = () => go(N - 1);
  $("play").onclick = play;
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT") return;
    if (e.key === "ArrowRight") { go(cur + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft") { go(cur - 1); e.preventDefault(); }
    else if (e.key === "Home") go(0);
    else if (e.key === "End") go(N - 1);
    else if (e.key === " ") { play(); e.preventDefault(); }
  });
  if (N) render();
  window.arlmTrace = {go, get step() { return cur; }, steps: N};
})();
