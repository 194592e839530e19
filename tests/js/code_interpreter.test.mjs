// The official @e2b/code-interpreter JS SDK (2.8.0), unchanged: Sandbox.create() asks for
// template code-interpreter-v1, which the server builds on first use (minutes the first time,
// hence the long request timeout), then runCode over the code-interpreter protocol on :49999.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

const BUILD_TIMEOUT_MS = 900_000

describe('code interpreter', () => {
  let sbx
  const made = []
  before(async () => {
    sbx = await Sandbox.create({ timeoutMs: 600_000, requestTimeoutMs: BUILD_TIMEOUT_MS })
    made.push(sbx)
  })
  after(async () => { await Promise.all(made.map((s) => s.kill().catch(() => {}))) })

  test('state across cells, main result and execution count', async () => {
    const first = await sbx.runCode('x = 41')
    assert.equal(first.error, undefined)
    const second = await sbx.runCode('x + 1')
    assert.equal(second.text, '42')
    assert.equal(second.results[0].isMainResult, true)
    assert.ok(second.executionCount > first.executionCount)
  })

  test('stdout and stderr stream to the callbacks while the cell runs', async () => {
    const out = []
    const err = []
    const t0 = Date.now()
    const execution = await sbx.runCode(
      'import sys, time\nfor i in range(3):\n    print(f"tick {i}", flush=True)\n    time.sleep(0.4)\n' +
      'print("oops", file=sys.stderr, flush=True)',
      { onStdout: (m) => out.push([m.line, Date.now() - t0]), onStderr: (m) => err.push(m.line) })
    assert.equal(execution.error, undefined)
    assert.equal(out.map(([line]) => line).join(''), 'tick 0\ntick 1\ntick 2\n')
    assert.deepEqual(err, ['oops\n'])
    assert.ok(out.at(-1)[1] - out[0][1] > 600, `not streamed: ${JSON.stringify(out)}`)
  })

  test('errors carry name, value and traceback', async () => {
    const seen = []
    const execution = await sbx.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => seen.push(e) })
    assert.equal(execution.error.name, 'ZeroDivisionError')
    assert.equal(execution.error.value, 'division by zero')
    assert.match(execution.error.traceback, /return 1 \/ 0/)
    assert.equal(seen.length, 1)
  })

  test('a matplotlib chart as PNG and a DataFrame as HTML', async () => {
    const chart = await sbx.runCode(
      'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()')
    assert.equal(chart.error, undefined)
    const png = Buffer.from(chart.results.find((r) => r.png).png, 'base64')
    assert.deepEqual([...png.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
    const df = await sbx.runCode("import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima']})")
    assert.match(df.results[0].html, /<table[\s\S]*Lima/)
  })

  test('contexts: own state and cwd; list, restart, remove', async () => {
    await sbx.commands.run('mkdir -p /tmp/js-ctx')
    const ctx = await sbx.createCodeContext({ cwd: '/tmp/js-ctx' })
    assert.equal(ctx.cwd, '/tmp/js-ctx')
    assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp/js-ctx')
    await sbx.runCode("only_here = 'ctx'", { context: ctx })
    assert.equal((await sbx.runCode('only_here', { context: ctx })).text, 'ctx')
    assert.equal((await sbx.runCode('only_here')).error.name, 'NameError')
    assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode('only_here', { context: ctx })).error.name, 'NameError')
    await sbx.removeCodeContext(ctx)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  })

  test('bash as a language', async () => {
    const execution = await sbx.runCode('cd /tmp && echo "in $PWD"', { language: 'bash' })
    assert.equal(execution.error, undefined)
    assert.equal(execution.logs.stdout.join(''), 'in /tmp\n')
  })

  test('kernel state survives pause and connect, and fork children continue from it', async () => {
    const s = await Sandbox.create({ timeoutMs: 300_000 })
    made.push(s)
    await s.runCode('import random\nseed = random.random()\nsteps = [1]')
    const seed = (await s.runCode('seed')).text
    await s.pause()
    const resumed = await Sandbox.connect(s.sandboxId)
    assert.equal((await resumed.runCode('seed')).text, seed)
    const children = (await resumed.fork({ count: 2 })).filter((c) => c instanceof Sandbox)
    made.push(...children)
    assert.equal(children.length, 2)
    const steps = await Promise.all(children.map(async (c, i) => {
      assert.equal((await c.runCode('seed')).text, seed)
      return (await c.runCode(`steps.append(${i + 2}); steps`)).text
    }))
    assert.deepEqual(steps, ['[1, 2]', '[1, 3]'])
    assert.equal((await resumed.runCode('steps')).text, '[1]')
  })
})
