#!/usr/bin/env node
// An independent reader of kvstore's formats, written from docs/FORMAT.md alone (plain Node, no
// dependencies): chunks, manifests, layout ids, chunk keys and the ssd tier's records. It prints
// what it decoded as JSON; tests/test_format_reader.py compares every field with the Python code.
//
//   node read_chunk.js layout-ids LAYOUTS.json           -> {name: layout id hex}
//   node read_chunk.js chunk FILE LAYOUTS.json [NS PARENT_HEX]
//   node read_chunk.js manifest FILE LAYOUTS.json
//   node read_chunk.js turn-record FILE                   -> one turn record (FORMAT.md section 3, "Turns")
//   node read_chunk.js session LAYOUTS.json MANIFEST [RECORD...]
//                                                         -> the session a manifest and its turn records
//                                                            (the values of m:<ns>/<sid> and of its
//                                                            t:<ns>/<sid>\0<seq> keys, in key order) make
//   node read_chunk.js record FILE                        -> the record's framing (where its frames are, the
//                                                           size each frame declares), any flag (0 to 3)
//   node read_chunk.js record-join FILE FRAMES_DIR OUT    -> the value (a chunk, a page blob), from the record
//                                                           and its frames decompressed by any zstd (frame-<i>.bin)
// LAYOUTS.json: a list of layout definitions {name, caches: [{name, layer, m, channels, fmt}],
// n_layers, window, swa_entry_bytes, persists_swa}.
// Node 20 has no zstd, so record-join takes the frames' contents from files; everything else
// (framing, the frames' declared sizes, sign plane, magnitude streams, residuals, byte planes, flag 3's
// runs and gaps) is done here.
'use strict';
const fs = require('fs');
const path = require('path');

const M64 = (1n << 64n) - 1n;
const u64 = (b, o) => b.readBigUInt64LE(o);

// ---- BLAKE2b (RFC 7693), digest length nn -------------------------------------------------------
const B2_IV = [0x6a09e667f3bcc908n, 0xbb67ae8584caa73bn, 0x3c6ef372fe94f82bn, 0xa54ff53a5f1d36f1n,
  0x510e527fade682d1n, 0x9b05688c2b3e6c1fn, 0x1f83d9abfb41bd6bn, 0x5be0cd19137e2179n];
const SIGMA = [
  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
  [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4], [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
  [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13], [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
  [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11], [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
  [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5], [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0]];
const rotr = (x, n) => ((x >> n) | (x << (64n - n))) & M64;

function blake2b(data, nn) {
  const h = B2_IV.slice();
  h[0] ^= 0x01010000n ^ BigInt(nn);
  const blocks = Math.max(1, Math.ceil(data.length / 128));
  for (let i = 0; i < blocks; i++) {
    const block = Buffer.alloc(128);
    data.copy(block, 0, i * 128, Math.min(data.length, (i + 1) * 128));
    const m = Array.from({ length: 16 }, (_, j) => u64(block, 8 * j));
    const last = i === blocks - 1;
    const t = BigInt(last ? data.length : (i + 1) * 128);
    const v = [...h, ...B2_IV];
    v[12] ^= t & M64;
    v[13] ^= t >> 64n;
    if (last) v[14] ^= M64;
    const G = (a, b, c, d, x, y) => {
      v[a] = (v[a] + v[b] + x) & M64; v[d] = rotr(v[d] ^ v[a], 32n);
      v[c] = (v[c] + v[d]) & M64; v[b] = rotr(v[b] ^ v[c], 24n);
      v[a] = (v[a] + v[b] + y) & M64; v[d] = rotr(v[d] ^ v[a], 16n);
      v[c] = (v[c] + v[d]) & M64; v[b] = rotr(v[b] ^ v[c], 63n);
    };
    for (let r = 0; r < 12; r++) {
      const s = SIGMA[r % 10];
      G(0, 4, 8, 12, m[s[0]], m[s[1]]); G(1, 5, 9, 13, m[s[2]], m[s[3]]);
      G(2, 6, 10, 14, m[s[4]], m[s[5]]); G(3, 7, 11, 15, m[s[6]], m[s[7]]);
      G(0, 5, 10, 15, m[s[8]], m[s[9]]); G(1, 6, 11, 12, m[s[10]], m[s[11]]);
      G(2, 7, 8, 13, m[s[12]], m[s[13]]); G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (let j = 0; j < 8; j++) h[j] ^= v[j] ^ v[j + 8];
  }
  const out = Buffer.alloc(64);
  h.forEach((x, j) => out.writeBigUInt64LE(x, 8 * j));
  return out.subarray(0, nn);
}

// ---- XXH3 (xxhash 0.8, seed 0, default secret): 64-bit for > 16 bytes, 128-bit for > 240 bytes --
const SECRET = Buffer.from(
  'b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221' +
  'b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8' +
  'a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb' +
  '170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e', 'hex');
const P32_1 = 0x9E3779B1n, P32_2 = 0x85EBCA77n, P32_3 = 0xC2B2AE3Dn;
const P64_1 = 0x9E3779B185EBCA87n, P64_2 = 0xC2B2AE3D27D4EB4Fn, P64_3 = 0x165667B19E3779F9n;
const P64_4 = 0x85EBCA77C2B2AE63n, P64_5 = 0x27D4EB2F165667C5n, PMX1 = 0x165667919E3779F9n;

const fold = (a, b) => { const p = a * b; return (p & M64) ^ (p >> 64n); };
const avalanche = (h) => { h ^= h >> 37n; h = (h * PMX1) & M64; return h ^ (h >> 32n); };
const mix16 = (d, o, s) => fold(u64(d, o) ^ u64(SECRET, s), u64(d, o + 8) ^ u64(SECRET, s + 8));

function xxh3Accs(d) {
  const acc = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];
  const stripe = (o, s) => {
    for (let i = 0; i < 8; i++) {
      const v = u64(d, o + 8 * i), k = v ^ u64(SECRET, s + 8 * i);
      acc[i ^ 1] = (acc[i ^ 1] + v) & M64;
      acc[i] = (acc[i] + (k & 0xFFFFFFFFn) * (k >> 32n)) & M64;
    }
  };
  const perBlock = (SECRET.length - 64) / 8, blockLen = 64 * perBlock;
  const nBlocks = Math.floor((d.length - 1) / blockLen);
  for (let b = 0; b < nBlocks; b++) {
    for (let s = 0; s < perBlock; s++) stripe(b * blockLen + 64 * s, 8 * s);
    for (let i = 0; i < 8; i++) {
      let a = acc[i];
      a ^= a >> 47n; a ^= u64(SECRET, SECRET.length - 64 + 8 * i);
      acc[i] = (a * P32_1) & M64;
    }
  }
  const nStripes = Math.floor((d.length - 1 - blockLen * nBlocks) / 64);
  for (let s = 0; s < nStripes; s++) stripe(nBlocks * blockLen + 64 * s, 8 * s);
  stripe(d.length - 64, SECRET.length - 64 - 7);
  return acc;
}

function merge(acc, s, start) {
  let r = start;
  for (let i = 0; i < 4; i++) {
    r = (r + fold(acc[2 * i] ^ u64(SECRET, s + 16 * i), acc[2 * i + 1] ^ u64(SECRET, s + 16 * i + 8))) & M64;
  }
  return avalanche(r);
}

function xxh3_64(d) {
  const len = BigInt(d.length);
  if (d.length <= 16) throw new Error('xxh3_64: inputs of 16 bytes or less are not implemented');
  if (d.length <= 128) {
    let acc = (len * P64_1) & M64;
    const n = d.length;
    if (n > 32) {
      if (n > 64) {
        if (n > 96) acc += mix16(d, 48, 96) + mix16(d, n - 64, 112);
        acc += mix16(d, 32, 64) + mix16(d, n - 48, 80);
      }
      acc += mix16(d, 16, 32) + mix16(d, n - 32, 48);
    }
    acc += mix16(d, 0, 0) + mix16(d, n - 16, 16);
    return avalanche(acc & M64);
  }
  if (d.length <= 240) {
    let acc = (len * P64_1) & M64;
    const rounds = Math.floor(d.length / 16);
    for (let i = 0; i < 8; i++) acc = (acc + mix16(d, 16 * i, 16 * i)) & M64;
    acc = avalanche(acc);
    for (let i = 8; i < rounds; i++) acc = (acc + mix16(d, 16 * i, 16 * (i - 8) + 3)) & M64;
    acc = (acc + mix16(d, d.length - 16, 136 - 17)) & M64;
    return avalanche(acc);
  }
  return merge(xxh3Accs(d), 11, (len * P64_1) & M64);
}

function xxh3_128(d) {  // canonical bytes: high 64 bits then low, each big-endian
  if (d.length <= 240) throw new Error('xxh3_128: inputs of 240 bytes or less are not implemented');
  const acc = xxh3Accs(d), len = BigInt(d.length);
  const lo = merge(acc, 11, (len * P64_1) & M64);
  const hi = merge(acc, SECRET.length - 64 - 11, ~((len * P64_2) & M64) & M64);
  const out = Buffer.alloc(16);
  out.writeBigUInt64BE(hi, 0);
  out.writeBigUInt64BE(lo, 8);
  return out;
}

// ---- layouts -----------------------------------------------------------------------------------
const FORMATS = {  // block, scale kind
  'fp4-e2m1/e4m3x16': { block: 16, scale: 'e4m3' },
  'fp4-e2m1/ue8m0x32': { block: 32, scale: 'ue8m0' },
};

function canonicalJson(x) {  // sorted keys, no whitespace, non-ASCII escaped
  if (Array.isArray(x)) return '[' + x.map(canonicalJson).join(',') + ']';
  if (x !== null && typeof x === 'object') {
    return '{' + Object.keys(x).sort().map((k) => canonicalJson(k) + ':' + canonicalJson(x[k])).join(',') + '}';
  }
  if (typeof x === 'string') return JSON.stringify(x).replace(/[\u007f-\uffff]/g, (c) => '\\u' + c.charCodeAt(0).toString(16).padStart(4, '0'));
  return JSON.stringify(x);
}

function layoutId(lay) {
  const d = { caches: lay.caches.map((c) => ({ channels: c.channels, fmt: c.fmt, layer: c.layer, m: c.m, name: c.name })),
    n_layers: lay.n_layers, persists_swa: lay.persists_swa, swa_entry_bytes: lay.swa_entry_bytes, window: lay.window };
  return blake2b(Buffer.from(canonicalJson(d), 'utf8'), 16).toString('hex');
}

const widths = (c) => ({ codes: c.channels / 2, scales: c.channels / FORMATS[c.fmt].block });

// ---- values ------------------------------------------------------------------------------------
const E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6];
const e2m1 = (code) => (code & 8 ? -1 : 1) * E2M1[code & 7];
function e4m3(b) {
  if ((b & 0x7F) === 0x7F) return NaN;
  const s = b & 0x80 ? -1 : 1, e = (b >> 3) & 15, f = b & 7;
  return s * (e === 0 ? 2 ** -6 * (f / 8) : 2 ** (e - 7) * (1 + f / 8));
}
const ue8m0 = (b) => 2 ** (b - 127);

// ---- chunk -------------------------------------------------------------------------------------
class FormatError extends Error {
  constructor(kind, msg) { super(msg); this.kind = kind; }
}

function readChunk(buf, layouts, ns, parentHex) {
  // The validation order of docs/FORMAT.md section 2.
  if (buf.length < 80) throw new FormatError('TruncatedChunk', `${buf.length} bytes`);
  if (buf.toString('latin1', 0, 4) !== 'KVCK') throw new FormatError('BadMagic', 'not KVCK');
  const h = {
    version: buf.readUInt16LE(4), header_bytes: buf.readUInt16LE(6), total_bytes: buf.readUInt32LE(8),
    token_count: buf.readUInt32LE(12), start: Number(buf.readBigUInt64LE(16)), layout_id: buf.toString('hex', 24, 40),
    key: buf.toString('hex', 40, 56), tokens_offset: buf.readUInt32LE(56), n_sections: buf.readUInt16LE(60),
    flags: buf.readUInt16LE(62), compressible_offset: buf.readUInt32LE(64), reserved: buf.readUInt32LE(68),
  };
  if (h.version !== 1) throw new FormatError('UnsupportedVersion', `version ${h.version}`);
  if (h.total_bytes > 2 ** 31) throw new FormatError('OversizedChunk', 'over 2 GiB');
  if (buf.length < h.total_bytes) throw new FormatError('TruncatedChunk', 'shorter than total_bytes');
  if (buf.length > h.total_bytes) throw new FormatError('OversizedChunk', 'trailing data');
  const T = h.token_count;
  if (h.header_bytes < 72 + 16 * h.n_sections || h.tokens_offset + 4 * T > h.total_bytes - 8 ||
      h.tokens_offset < h.header_bytes || h.compressible_offset < h.header_bytes ||
      h.compressible_offset > h.tokens_offset) {
    throw new FormatError('MalformedChunk', 'table, split or token ids outside the chunk');
  }
  const stored = buf.readBigUInt64LE(h.total_bytes - 8);
  if (xxh3_64(buf.subarray(0, h.total_bytes - 8)) !== stored) throw new FormatError('ChecksumMismatch', 'checksum');
  const lay = layouts.find((l) => layoutId(l) === h.layout_id);
  if (!lay) throw new FormatError('LayoutMismatch', `unknown layout ${h.layout_id}`);
  if (h.n_sections !== 2 * lay.caches.length) throw new FormatError('MalformedChunk', 'section count');
  const sections = [], seen = new Set(), caches = {};
  for (let i = 0; i < h.n_sections; i++) {
    const o = 72 + 16 * i;
    const s = { cache_index: buf.readUInt16LE(o), kind: buf[o + 2], pad: buf[o + 3], entries: buf.readUInt32LE(o + 4),
      offset: buf.readUInt32LE(o + 8), length: buf.readUInt32LE(o + 12) };
    const c = lay.caches[s.cache_index];
    if (!c || (s.kind !== 0 && s.kind !== 1)) throw new FormatError('MalformedChunk', `section ${i}`);
    const w = s.kind === 0 ? widths(c).codes : widths(c).scales;
    const [lo, hi] = s.kind === 0 ? [h.header_bytes, h.compressible_offset] : [h.compressible_offset, h.tokens_offset];
    if (s.entries !== Math.floor(T / c.m) || s.length !== s.entries * w || s.offset < lo || s.offset + s.length > hi) {
      throw new FormatError('MalformedChunk', `section ${i} bounds`);
    }
    if (seen.has(`${s.cache_index}/${s.kind}`)) throw new FormatError('MalformedChunk', `section ${i} twice`);
    seen.add(`${s.cache_index}/${s.kind}`);
    sections.push(s);
    (caches[c.name] = caches[c.name] || {})[s.kind === 0 ? 'codes' : 'scales'] = buf.subarray(s.offset, s.offset + s.length);
  }
  if (seen.size !== h.n_sections) throw new FormatError('MalformedChunk', 'a cache lacks a section');
  const used = sections.filter((s) => s.length > 0).sort((a, b) => a.offset - b.offset);
  for (let i = 1; i < used.length; i++) {
    if (used[i].offset < used[i - 1].offset + used[i - 1].length) throw new FormatError('MalformedChunk', 'overlap');
  }
  const ids = [];
  for (let t = 0; t < T; t++) ids.push(buf.readUInt32LE(h.tokens_offset + 4 * t));
  const out = { header: h, layout: lay.name, sections, token_ids: ids, checksum: stored.toString(16).padStart(16, '0'),
    caches: {}, dequantized: {} };
  for (const c of lay.caches) {
    const { codes, scales } = caches[c.name], w = widths(c), fmt = FORMATS[c.fmt];
    out.caches[c.name] = { codes_hex: codes.toString('hex'), scales_hex: scales.toString('hex') };
    const rows = [];
    for (let e = 0; e < Math.min(2, codes.length / w.codes); e++) {  // the first two entries, by hand
      const row = [];
      for (let j = 0; j < c.channels; j++) {
        const byte = codes[e * w.codes + (j >> 1)], code = j & 1 ? byte >> 4 : byte & 15;
        const sb = scales[e * w.scales + Math.floor(j / fmt.block)];
        row.push(e2m1(code) * (fmt.scale === 'e4m3' ? e4m3(sb) : ue8m0(sb)));
      }
      rows.push(row);
    }
    out.dequantized[c.name] = rows;
  }
  if (ns !== undefined && T > 0) {
    const nsb = Buffer.from(ns, 'utf8'), len = Buffer.alloc(2);
    len.writeUInt16LE(nsb.length);
    const msg = Buffer.concat([Buffer.from('kvstore.chunk.v1\0', 'latin1'), Buffer.from(h.layout_id, 'hex'), len, nsb,
      Buffer.from(parentHex, 'hex'), buf.subarray(h.tokens_offset, h.tokens_offset + 4 * T)]);
    out.computed_key = msg.length > 240 ? xxh3_128(msg).toString('hex') : null;  // C >= 48: always long
  }
  return out;
}

// ---- manifest ----------------------------------------------------------------------------------
function readManifest(buf, layouts) {
  if (buf.length < 22) throw new FormatError('ManifestError', 'truncated');
  if (buf.toString('latin1', 0, 4) !== 'KVMF' || buf.readUInt16LE(4) !== 1) throw new FormatError('ManifestError', 'magic/version');
  const stored = buf.readBigUInt64LE(buf.length - 8);
  if (xxh3_64(buf.subarray(0, buf.length - 8)) !== stored) throw new FormatError('ManifestError', 'checksum');
  const metaLen = buf.readUInt32LE(6);
  const meta = JSON.parse(buf.toString('utf8', 10, 10 + metaLen));
  const tailLen = buf.readUInt32LE(10 + metaLen);
  const tail = buf.subarray(14 + metaLen, 14 + metaLen + tailLen);
  return { version: 1, meta, tail_len: tailLen, tail: readChunk(tail, layouts), checksum: stored.toString(16).padStart(16, '0') };
}

// ---- turn records (section 3, "Turns") ----------------------------------------------------------
function readTurnRecord(buf) {
  // The checks in the doc's order: length, magic and version, checksum, lengths.
  if (buf.length < 66) throw new FormatError('ManifestError', 'turn record truncated');
  if (buf.toString('latin1', 0, 4) !== 'KVMT' || buf.readUInt16LE(4) !== 1) throw new FormatError('ManifestError', 'turn record magic/version');
  const stored = buf.readBigUInt64LE(buf.length - 8);
  if (xxh3_64(buf.subarray(0, buf.length - 8)) !== stored) throw new FormatError('ManifestError', 'turn record checksum');
  const r = { base: buf.readBigUInt64LE(6), generation: buf.readBigUInt64LE(14), first_chunk: Number(buf.readBigUInt64LE(22)),
    token_count: Number(buf.readBigUInt64LE(34)), updated_at: buf.readDoubleLE(42) };
  const nKeys = buf.readUInt32LE(30), nIds = buf.readUInt32LE(50), tailLen = buf.readUInt32LE(54);
  if (58 + 16 * nKeys + 4 * nIds + tailLen + 8 !== buf.length) throw new FormatError('ManifestError', 'turn record lengths');
  let at = 58;
  r.chunk_keys = Array.from({ length: nKeys }, (_, i) => buf.toString('hex', at + 16 * i, at + 16 * (i + 1)));
  at += 16 * nKeys;
  r.last_token_ids = Array.from({ length: nIds }, (_, i) => buf.readUInt32LE(at + 4 * i));
  at += 4 * nIds;
  r.tail = buf.subarray(at, at + tailLen);
  return r;
}

function readSession(manifestBuf, recordBufs, layouts) {
  // The manifest, then each record while it decodes and extends the version so far; the first that does
  // not ends it. A result that breaks the manifest's counts: the manifest alone.
  const base = readManifest(manifestBuf, layouts);
  const m = base.meta;
  let gen = BigInt(m.generation || 0), keys = m.chunk_keys.slice(), last = null, applied = 0;
  for (const b of recordBufs) {
    let r;
    try { r = readTurnRecord(b); } catch (e) { if (e instanceof FormatError) break; throw e; }
    if (r.base !== gen || r.first_chunk !== keys.length || r.generation <= gen) break;
    keys = keys.concat(r.chunk_keys);
    gen = r.generation;
    last = r;
    applied += 1;
  }
  const pages = m.kind === 'engine-pages' || (m.chunk_tokens === 0 && m.kind === undefined);
  const t = last && last.token_count - keys.length * m.chunk_tokens;
  const ok = last && (pages ? m.chunk_tokens === 0 && last.tail.length === 0 && last.last_token_ids.length === 0
    : m.chunk_tokens > 0 && t >= 0 && t < m.chunk_tokens);
  if (!ok) return { meta: m, tail_len: base.tail_len, tail: base.tail, turn_records: 0 };
  const meta = { ...m, chunk_keys: keys, token_count: last.token_count, last_token_ids: last.last_token_ids,
    generation: Number(gen), updated_at: last.updated_at };
  const tail = last.tail.length ? readChunk(last.tail, layouts) : null;
  return { meta, tail_len: last.tail.length, tail, turn_records: applied };
}

// ---- ssd record --------------------------------------------------------------------------------
function declaredSize(rec, at, n) {
  // A zstd frame's Frame_Content_Size (RFC 8878 3.1.1.1): null when the frame does not declare it;
  // CorruptValue when no frame header is there.
  const bad = () => new FormatError('CorruptValue', 'not a zstd frame header');
  if (n < 5 || rec.readUInt32LE(at) !== 0xFD2FB528) throw bad();
  const fhd = rec[at + 4], fcsFlag = fhd >> 6, single = (fhd >> 5) & 1;
  if (fhd & 8) throw bad();  // the reserved bit
  const fcsBytes = [single ? 1 : 0, 2, 4, 8][fcsFlag];
  const o = at + 5 + (single ? 0 : 1) + [0, 1, 2, 4][fhd & 3];
  if (o + fcsBytes > at + n) throw bad();
  if (fcsBytes === 0) return null;
  if (fcsBytes === 1) return rec[o];
  if (fcsBytes === 2) return rec.readUInt16LE(o) + 256;
  if (fcsBytes === 4) return rec.readUInt32LE(o);
  return Number(rec.readBigUInt64LE(o));
}

function runsFraming(rec, raw_len, prefix) {
  // Flag 3 (FORMAT.md section 5, "Flag 3" and "Reading a flag 3 record"): the runs table, the raw part
  // (V[0 : P] less the runs), then one frame of the runs' bytes and V[P : raw_len], to the end.
  const bad = (why) => new FormatError('CorruptValue', `flag 3: ${why}`);
  if (rec.length < 11) throw bad('no run count');
  const G = rec.readUInt16LE(9), at = 11 + 16 * G;
  if (G < 1) throw bad('no runs');
  if (rec.length < at) throw bad('runs table past the record');
  if (prefix > raw_len) throw bad('prefix past raw_len');
  const runs = [];
  let end = 0, R = 0;
  for (let i = 0; i < G; i++) {
    const o = 11 + 16 * i, r = [rec.readUInt32LE(o), rec.readUInt32LE(o + 4), rec.readUInt32LE(o + 8), rec.readUInt32LE(o + 12)];
    const [off, length, stride, count] = r;
    if (length < 1 || count < 1 || stride < length || off < end) throw bad(`run ${i} invalid or out of order`);
    end = off + (count - 1) * stride + length;
    R += length * count;
    runs.push(r);
  }
  if (end > prefix) throw bad('runs past the prefix');
  const rawN = prefix - R;
  if (at + rawN > rec.length) throw bad('raw part past the record');
  const frameAt = at + rawN, size = R + raw_len - prefix, declared = declaredSize(rec, frameAt, rec.length - frameAt);
  if (declared !== size) throw bad(`frame declares ${declared} bytes, not ${size}`);
  return { flag: 3, raw_len, prefix, runs, gathered: R, raw: [at, rawN], frames: [[frameAt, rec.length - frameAt]],
    frame_sizes: [size], declared: [declared] };
}

function recordFraming(rec) {
  if (rec.length < 9) throw new FormatError('CorruptValue', 'shorter than the record header');
  const flag = rec[0], raw_len = rec.readUInt32LE(1), prefix = rec.readUInt32LE(5);
  if (flag === 0) {
    if (rec.length - 9 !== raw_len || prefix !== raw_len) throw new FormatError('CorruptValue', 'flag 0: lengths');
    return { flag, raw_len, prefix, value: [9, raw_len] };
  }
  if (flag === 1) {
    if (prefix >= raw_len || prefix > rec.length - 9) throw new FormatError('CorruptValue', 'flag 1: prefix');
    const f = [9 + prefix, rec.length - 9 - prefix], declared = declaredSize(rec, f[0], f[1]);
    if (declared !== raw_len - prefix) throw new FormatError('CorruptValue', `flag 1: frame declares ${declared} bytes`);
    return { flag, raw_len, prefix, raw: [9, prefix], frames: [f], frame_sizes: [raw_len - prefix], declared: [declared] };
  }
  if (flag === 3) return runsFraming(rec, raw_len, prefix);
  if (flag !== 2) throw new FormatError('CorruptValue', `flag ${flag}`);
  const F = rec.readUInt16LE(9);
  let at = 11 + 4 * F;
  const lens = Array.from({ length: F }, (_, i) => rec.readUInt32LE(11 + 4 * i));
  const chunkHead = rec.subarray(at, at + prefix);
  at += prefix;
  const S = chunkHead.readUInt32LE(64), L = S - prefix;
  const signs = [at, Math.ceil(L / 4)];
  at += signs[1];
  const frames = lens.map((n) => { const f = [at, n]; at += n; return f; });
  frames.push([at, rec.length - at]);  // the tail frame
  return { flag, raw_len, prefix, raw: [11 + 4 * F, prefix], signs, frames,
    declared: frames.map(([a, n]) => declaredSize(rec, a, n)) };
}

function joinRuns(rec, fr, framesDir) {
  // Flag 3's inverse: the raw part into the gaps the runs leave in [0, P), in offset order; the frame's
  // first R bytes into the runs (run by run, instance by instance); the rest to V[P:].
  const packed = fs.readFileSync(path.join(framesDir, 'frame-0.bin'));
  if (packed.length !== fr.frame_sizes[0]) {
    throw new FormatError('CorruptValue', `flag 3: frame holds ${packed.length} bytes, not ${fr.frame_sizes[0]}`);
  }
  const out = Buffer.alloc(fr.raw_len), raw = rec.subarray(fr.raw[0], fr.raw[0] + fr.raw[1]);
  let pos = 0, cut = 0, src = 0;  // pos: bytes of V[0 : P] placed; cut: of the raw part used; src: of the frame
  for (const [off, length, stride, count] of fr.runs) {
    for (let i = 0; i < count; i++) {
      const start = off + i * stride;
      raw.copy(out, pos, cut, cut + start - pos);
      cut += start - pos;
      packed.copy(out, start, src, src + length);
      src += length;
      pos = start + length;
    }
  }
  raw.copy(out, pos, cut, cut + fr.prefix - pos);
  packed.copy(out, fr.prefix, fr.gathered);
  return out;
}

function plan(head, rawLen) {  // what the doc's flag-2 section derives from the chunk header + table
  const H = head.readUInt16LE(6), T = head.readUInt32LE(12), O = head.readUInt32LE(56), n = head.readUInt16LE(60);
  const S = head.readUInt32LE(64);
  const secs = Array.from({ length: n }, (_, i) => {
    const o = 72 + 16 * i;
    return { cache: head.readUInt16LE(o), kind: head[o + 2], entries: head.readUInt32LE(o + 4),
      offset: head.readUInt32LE(o + 8), length: head.readUInt32LE(o + 12) };
  });
  const scaleLen = {};
  secs.filter((s) => s.kind === 1).forEach((s) => { scaleLen[s.cache] = s.length; });
  const groups = new Map();
  for (const s of secs) {
    if (s.kind !== 0 || s.entries === 0) continue;
    const sl = scaleLen[s.cache] || 0, g = sl ? Math.floor(s.length / sl) : 0;
    if (!groups.has(g)) groups.set(g, []);
    groups.get(g).push(s);
  }
  const scales = secs.filter((s) => s.kind === 1 && s.entries > 0);
  return { H, T, O, S, rawLen, groups: [...groups.values()], scales };
}

function joinRecord(rec, framesDir) {
  const fr = recordFraming(rec);
  if (fr.flag === 0) return rec.subarray(9, 9 + fr.raw_len);
  if (fr.flag === 1) {
    const rest = fs.readFileSync(path.join(framesDir, 'frame-0.bin'));
    if (rest.length !== fr.raw_len - fr.prefix) throw new FormatError('CorruptValue', 'flag 1: frame size');
    return Buffer.concat([rec.subarray(9, 9 + fr.prefix), rest]);
  }
  if (fr.flag === 3) return joinRuns(rec, fr, framesDir);
  const head = rec.subarray(fr.raw[0], fr.raw[0] + fr.raw[1]);
  const p = plan(head, fr.raw_len);
  const frame = (i) => fs.readFileSync(path.join(framesDir, `frame-${i}.bin`));
  const out = Buffer.alloc(p.rawLen);
  head.copy(out, 0);
  // codes: the magnitude stream (groups' sections, then padding), then the signs
  const L = p.S - p.H;
  const runs = p.groups.flat().map((s) => [s.offset - p.H, s.length]);
  const covered = new Uint8Array(L);
  runs.forEach(([a, n]) => covered.fill(1, a, a + n));
  for (let i = 0; i < L; i++) if (!covered[i]) runs.push([i, 1]);
  const stream = Buffer.concat(fr.frames.slice(0, -1).map((_, i) => frame(i)));
  let at = 0;
  for (const [a, n] of runs) { stream.copy(out, p.H + a, at, at + n); at += n; }
  const signs = rec.subarray(fr.signs[0], fr.signs[0] + fr.signs[1]);
  for (let i = 0; i < L; i++) {
    const m = out[p.H + i], sEven = (signs[(2 * i) >> 3] >> ((2 * i) & 7)) & 1;
    const sOdd = (signs[(2 * i + 1) >> 3] >> ((2 * i + 1) & 7)) & 1;
    out[p.H + i] = (m & 7) | ((m & 0x38) << 1) | (sEven << 3) | (sOdd << 7);
  }
  // tail: copy, then undo the residuals (bases appended at the end) and the byte planes
  const t = frame(fr.frames.length - 1);
  t.copy(out, p.S, 0, p.rawLen - p.S);
  let base = p.rawLen - p.S;
  for (const s of p.scales) {
    const n = s.entries, w = s.length / n;
    for (let e = 0; e < n; e++) {
      for (let j = 0; j < w; j++) out[s.offset + e * w + j] = (t[s.offset - p.S + j * n + e] + t[base + j]) & 0xFF;
    }
    base += w;
  }
  for (let i = 0; i < p.T; i++) {
    for (let b = 0; b < 4; b++) out[p.O + 4 * i + b] = t[p.O - p.S + b * p.T + i];
  }
  return out;
}

// ---- main --------------------------------------------------------------------------------------
function main(argv) {
  const [cmd, file, arg2, arg3, arg4] = argv;
  const layouts = () => JSON.parse(fs.readFileSync(arg2, 'utf8'));
  let out;
  try {
    if (cmd === 'layout-ids') out = Object.fromEntries(JSON.parse(fs.readFileSync(file, 'utf8')).map((l) => [l.name, layoutId(l)]));
    else if (cmd === 'chunk') out = readChunk(fs.readFileSync(file), layouts(), arg3, arg4);
    else if (cmd === 'manifest') out = readManifest(fs.readFileSync(file), layouts());
    else if (cmd === 'turn-record') {
      const r = readTurnRecord(fs.readFileSync(file));
      out = { ...r, base: r.base.toString(), generation: r.generation.toString(), tail: r.tail.toString('hex') };
    } else if (cmd === 'session') {
      const lays = JSON.parse(fs.readFileSync(file, 'utf8'));
      out = readSession(fs.readFileSync(arg2), argv.slice(3).map((f) => fs.readFileSync(f)), lays);
    } else if (cmd === 'record') out = recordFraming(fs.readFileSync(file));
    else if (cmd === 'record-join') { const b = joinRecord(fs.readFileSync(file), arg2); fs.writeFileSync(arg3, b); out = { written: b.length }; }
    else throw new Error(`unknown command ${cmd}`);
  } catch (e) {
    if (!(e instanceof FormatError)) throw e;
    out = { error: e.kind, message: e.message };
  }
  process.stdout.write(JSON.stringify(out, (k, v) => (typeof v === 'number' && !Number.isFinite(v) ? String(v) : v)) + '\n');
}

main(process.argv.slice(2));
