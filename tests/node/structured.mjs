// The Vercel AI SDK (`ai`, `@ai-sdk/openai`), unmodified, against a running gateway:
// `node structured.mjs BASE_URL API_KEY MODEL`. generateObject on the provider's Responses
// model and its Chat Completions model, and streamObject on the Chat model, each with a zod
// schema. Prints one JSON object on its last line: each object, and the schema as JSON.
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, streamObject } from "ai";
import { z } from "zod";

const [baseURL, apiKey, model] = process.argv.slice(2);
const provider = createOpenAI({ baseURL, apiKey });

const City = z.object({
  name: z.string().describe("The city's name"),
  country: z.string(),
  population: z.number().int(),
  kind: z.enum(["capital", "town"]),
  landmarks: z.array(z.string()),
  motto: z.string().nullable(),
});
const prompt = "Describe Paris, the capital of France, with two landmarks.";

const responses = await generateObject({ model: provider.responses(model), schema: City, prompt });
const chat = await generateObject({ model: provider.chat(model), schema: City, prompt });
const stream = streamObject({ model: provider.chat(model), schema: City, prompt });
let partials = 0;
for await (const _ of stream.partialObjectStream) partials += 1;
const streamed = await stream.object;

console.log(
  JSON.stringify({
    schema: z.toJSONSchema(City),
    responses: responses.object,
    chat: chat.object,
    streamed,
    partials,
    finish: chat.finishReason,
  }),
);
