// PTY through the official JS SDK: create, input, output, resize, kill.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { createSandbox, waitUntil } from './helpers.mjs'

describe('pty', () => {
  let sbx
  before(async () => { sbx = await createSandbox() })
  after(async () => { await sbx?.kill() })

  test('an interactive shell: input, output, resize, kill', async () => {
    const decoder = new TextDecoder()
    let out = ''
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += decoder.decode(d, { stream: true }) } })
    assert.ok(pty.pid > 0)
    const enc = new TextEncoder()
    await sbx.pty.sendInput(pty.pid, enc.encode('echo "pty-$((6*7))"; stty size\n'))
    await waitUntil(() => out.includes('pty-42') && out.includes('24 80'))
    await sbx.pty.resize(pty.pid, { cols: 132, rows: 50 })
    await sbx.pty.sendInput(pty.pid, enc.encode('stty size; tty\n'))
    await waitUntil(() => out.includes('50 132') && /\/dev\/pts\/\d+/.test(out))
    assert.equal(await sbx.pty.kill(pty.pid), true)
    const r = await pty.wait().catch((e) => e)
    assert.ok(r.exitCode !== 0 || r.error, JSON.stringify(r))
  })

  test('exit ends the pty normally, and connect() reattaches to a live one', async () => {
    let out = ''
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += Buffer.from(d).toString() } })
    const enc = new TextEncoder()
    let again = ''
    const second = await sbx.pty.connect(pty.pid, { onData: (d) => { again += Buffer.from(d).toString() } })
    await sbx.pty.sendInput(pty.pid, enc.encode('echo attached-$((1+1))\n'))
    await waitUntil(() => again.includes('attached-2') && out.includes('attached-2'))
    await sbx.pty.sendInput(pty.pid, enc.encode('exit 0\n'))
    const r = await pty.wait()
    assert.equal(r.exitCode, 0)
    await second.wait().catch(() => {})
  })
})
