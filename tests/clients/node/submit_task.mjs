// A SeamlessFlow client in another language: publish one task, as JSON, to a run's task stream.
// Usage: node submit_task.mjs NATS_URL SUBJECT TASK_JSON
// Prints the JetStream acknowledgement as JSON: {"stream": ..., "seq": ..., "duplicate": ...}.
import { connect, headers } from "nats";

const [url, subject, taskJson] = process.argv.slice(2);
const nc = await connect({ servers: url });
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
