// Shared by the JS SDK suite: sandboxes that are always killed, and polling.
import { Sandbox } from 'e2b'

/** Create a sandbox for one suite; `after` must call kill(). */
export async function createSandbox(opts = {}) {
  const { template, ...rest } = opts
  const all = { timeoutMs: 600_000, ...rest, metadata: { suite: 'js', ...(rest.metadata ?? {}) } }
  return template ? Sandbox.create(template, all) : Sandbox.create(all)
}

export async function waitUntil(check, { timeoutMs = 30_000, intervalMs = 100 } = {}) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const value = await check()
    if (value) return value
    if (Date.now() > deadline) throw new Error(`condition not met after ${timeoutMs} ms`)
    await new Promise((resolve) => setTimeout(resolve, intervalMs))
  }
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

export function uniqueId() {
  return Math.random().toString(36).slice(2, 14)
}
