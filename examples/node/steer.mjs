// Steer single requests of a `dynsteer serve` server from Node with the official OpenAI SDK (npm install openai).
//
//   dynsteer serve MODEL --api-key "$KEY"
//   KEY=... node examples/node/steer.mjs http://127.0.0.1:8000 VECTOR_NAME LAYER [SCALE]
//
// The steering object rides in the request body next to the OpenAI fields (the SDK sends unknown fields as given);
// VECTOR_NAME is a vector registered on the server (POST /v1/steering/vectors, or DynsteerConfig.vectors); take SCALE
// from `dynsteer dose recommend` for that vector and model (the strongest dose that keeps replies fluent).
import OpenAI from "openai";

const [baseURL, vector, layer, scale = "8"] = process.argv.slice(2);
if (!baseURL || !vector || !layer) {
  console.error("usage: node steer.mjs BASE_URL VECTOR_NAME LAYER [SCALE]");
  process.exit(2);
}
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: process.env.KEY ?? "none" });
const model = (await client.models.list()).data[0].id;
const steering = { spec: { vectors: [{ layer: Number(layer), vector, scale: Number(scale) }] } };
const prompt = "The weather today is";

const plain = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0 });
const steered = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0, steering });
const chat = await client.chat.completions.create({
  model, max_tokens: 16, temperature: 0, steering,
  messages: [{ role: "user", content: "Describe the weather today." }],
});
console.log(JSON.stringify({
  unsteered: plain.choices[0].text,
  steered: steered.choices[0].text,
  chat_steered: chat.choices[0].message.content,
}));
