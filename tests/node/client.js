// A stock grpc-js client, default channel options (4 MiB receive limit), as another language's
// user would write it against proto/kvstore/v1/kvstore.proto. Driven by tests/test_node_client.py:
//
//   node client.js ADDRESS NAMESPACE SESSION_ID
//
// Prints one JSON object: the health answers, the services listed by reflection v1 and v1alpha,
// the server info, and the streamed LoadSession (message count, largest message, byte count and
// the sha256 of the chunk bytes in order), or the error each step ended with.
"use strict";

const crypto = require("crypto");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const REPO = path.resolve(__dirname, "..", "..");
const OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };

function load(file, includeDirs) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, { ...OPTIONS, includeDirs }));
}

const kv = load("kvstore/v1/kvstore.proto", [path.join(REPO, "proto")]).kvstore.v1;
const health = load("health/v1/health.proto",
  [path.join(__dirname, "node_modules", "grpc-health-check", "proto")]).grpc.health.v1;
const reflectionDir = path.join(__dirname, "node_modules", "@grpc", "reflection", "build", "proto");
const reflectionV1 = load("grpc/reflection/v1/reflection.proto", [reflectionDir]).grpc.reflection.v1;
const reflectionV1alpha = load("grpc/reflection/v1alpha/reflection.proto",
  [reflectionDir]).grpc.reflection.v1alpha;

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: Date.now() + 20000 }, (err, res) =>
      resolve(err ? { error: { code: err.code, details: err.details } } : res));
  });
}

function listServices(pkg, address) {
  const client = new pkg.ServerReflection(address, grpc.credentials.createInsecure());
  return new Promise((resolve) => {
    const call = client.ServerReflectionInfo({ deadline: Date.now() + 20000 });
    call.on("data", (res) => {
      const list = res.list_services_response;
      resolve(list ? { services: list.service.map((s) => s.name).sort() } : { error: res.error_response });
      call.end();
    });
    call.on("error", (err) => resolve({ error: { code: err.code, details: err.details } }));
    call.write({ list_services: "" });
  });
}

function loadSession(client, namespace, sessionId) {
  return new Promise((resolve) => {
    const hash = crypto.createHash("sha256");
    const out = { messages: 0, max_message_bytes: 0, bytes: 0, chunk_keys: 0 };
    const call = client.LoadSession({ namespace, session_id: sessionId }, { deadline: Date.now() + 60000 });
    call.on("data", (msg) => {
      out.messages += 1;
      if (msg.session) out.chunk_keys = msg.session.chunk_keys.length;
      const data = msg.chunks ? msg.chunks.data : null;
      if (data && data.length) {
        hash.update(data);
        out.bytes += data.length;
        out.max_message_bytes = Math.max(out.max_message_bytes, data.length);
      }
    });
    call.on("error", (err) => resolve({ ...out, error: { code: err.code, details: err.details } }));
    call.on("end", () => resolve({ ...out, sha256: hash.digest("hex") }));
  });
}

async function main() {
  const [address, namespace, sessionId] = process.argv.slice(2);
  const creds = grpc.credentials.createInsecure();
  const store = new kv.KVStore(address, creds);
  const checker = new health.Health(address, creds);
  const result = {
    health: {
      overall: await unary(checker, "Check", { service: "" }),
      kvstore: await unary(checker, "Check", { service: "kvstore.v1.KVStore" }),
    },
    reflection_v1: await listServices(reflectionV1, address),
    reflection_v1alpha: await listServices(reflectionV1alpha, address),
    server_info: await unary(store, "GetServerInfo", {}),
    load: await loadSession(store, namespace, sessionId),
  };
  process.stdout.write(JSON.stringify(result) + "\n");
  process.exit(0);
}

main().catch((err) => {
  process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
  process.exit(2);
});
