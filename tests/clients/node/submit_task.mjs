// A SeamlessFlow client in another language: publish one task, as JSON, to a run's task stream.
// Usage: node submit_task.mjs NATS_URL SUBJECT TASK_JSON [IDENTITY_FILE]
// IDENTITY_FILE: an identity from `seamlessflow creds` (docs/protocol.md section 14); without
// one the client connects anonymously, which only an --insecure broker accepts.
// Prints the JetStream acknowledgement as JSON: {"stream": ..., "seq": ..., "duplicate": ...}.
import { readFileSync } from "node:fs";
import { connect, headers, nkeyAuthenticator } from "nats";

const [url, subject, taskJson, identityFile] = process.argv.slice(2);
const options = { servers: url };
if (identityFile) {
  // The identity file is flat TOML: key = "value" lines, and the seed on a line of its own.
  const text = readFileSync(identityFile, "utf8");
  const ident = Object.fromEntries([...text.matchAll(/^(\w+) = "([^"]*)"$/gm)].map((m) => [m[1], m[2]]));
  ident.seed = text.match(/^(SU[A-Z2-7]+)$/m)[1];
  options.authenticator = nkeyAuthenticator(new TextEncoder().encode(ident.seed));
  options.inboxPrefix = ident.inbox_prefix;
}
const nc = await connect(options);
const js = nc.jetstream();
const h = headers();
h.set("Content-Type", "application/json");
const task = JSON.parse(taskJson);
const ack = await js.publish(subject, new TextEncoder().encode(JSON.stringify(task)), {
  headers: h,
  msgID: task.task_id,
});
console.log(JSON.stringify({ stream: ack.stream, seq: ack.seq, duplicate: ack.duplicate }));
await nc.drain();
