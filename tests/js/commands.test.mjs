// Commands through the official JS SDK: foreground, background, streaming callbacks, stdin,
// kill, list, connect, and errors on a connection that is then reused.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { CommandExitError, TimeoutError } from 'e2b'
import { createSandbox, sleep, waitUntil } from './helpers.mjs'

describe('commands', () => {
  let sbx
  before(async () => { sbx = await createSandbox() })
  after(async () => { await sbx?.kill() })

  test('foreground run: stdout, stderr, exit code, env, cwd, user', async () => {
    const r = await sbx.commands.run('echo out; echo err >&2; echo "$GREETING" ; pwd; whoami',
      { envs: { GREETING: 'hi from js' }, cwd: '/tmp', user: 'root' })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'out\nhi from js\n/tmp\nroot\n')
    assert.equal(r.stderr, 'err\n')
    assert.equal((await sbx.commands.run('whoami')).stdout.trim(), 'user')
  })

  test('a non-zero exit is a CommandExitError, and the next call works', async () => {
    await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError, String(err))
      assert.equal(err.exitCode, 3)
      assert.equal(err.stderr, 'bad\n')
      return true
    })
    assert.equal((await sbx.commands.run('echo again')).stdout, 'again\n')
  })

  test('streaming callbacks see output before the command ends', async () => {
    const seen = []
    const started = Date.now()
    let firstAt = 0
    const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; echo e$i >&2; sleep 0.3; done', {
      onStdout: (d) => { if (!firstAt) firstAt = Date.now(); seen.push(['out', d]) },
      onStderr: (d) => seen.push(['err', d]),
    })
    assert.equal(r.stdout, 'line1\nline2\nline3\n')
    assert.equal(seen.filter(([k]) => k === 'out').map(([, d]) => d).join(''), r.stdout)
    assert.equal(seen.filter(([k]) => k === 'err').map(([, d]) => d).join(''), 'e1\ne2\ne3\n')
    assert.ok(firstAt - started < Date.now() - started - 400, 'first line arrived only at the end')
  })

  test('background command: wait, list, kill', async () => {
    const h = await sbx.commands.run('sleep 0.5; echo done-bg', { background: true })
    assert.ok(h.pid > 0)
    const r = await h.wait()
    assert.equal(r.stdout, 'done-bg\n')

    const sleeper = await sbx.commands.run('sleep 600', { background: true })
    const listed = await sbx.commands.list()
    const mine = listed.find((p) => p.pid === sleeper.pid)
    assert.ok(mine, JSON.stringify(listed))
    assert.equal(mine.cmd, '/bin/bash')
    assert.deepEqual(mine.args.slice(-1), ['sleep 600'])
    assert.equal(await sbx.commands.kill(sleeper.pid), true)
    await assert.rejects(sleeper.wait(), (err) => err instanceof CommandExitError && err.exitCode !== 0)
    await waitUntil(async () => !(await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
    assert.equal(await sbx.commands.kill(sleeper.pid), false)
  })

  test('handle.kill() ends a streaming command', async () => {
    const h = await sbx.commands.run('while true; do echo tick; sleep 0.1; done', { background: true })
    await waitUntil(() => h.stdout.includes('tick'))
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), CommandExitError)
  })

  test('stdin: sendStdin and closeStdin', async () => {
    const h = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'first line\n')
    await h.sendStdin(new TextEncoder().encode('second line\n'))
    await waitUntil(() => h.stdout.includes('second line'))
    await h.closeStdin()
    const r = await h.wait()
    assert.equal(r.stdout, 'first line\nsecond line\n')
  })

  test('connect to a running command from a second handle', async () => {
    const h = await sbx.commands.run('for i in $(seq 1 20); do echo n$i; sleep 0.1; done', { background: true })
    const chunks = []
    const again = await sbx.commands.connect(h.pid, { onStdout: (d) => chunks.push(d) })
    const r = await again.wait()
    assert.equal(r.exitCode, 0)
    assert.match(chunks.join(''), /n20\n$/)
    await h.disconnect()
  })

  test('timeoutMs ends a command that runs too long', async () => {
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1000 }), (err) => {
      assert.ok(err instanceof TimeoutError || /timeout|deadline/i.test(String(err)), String(err))
      return true
    })
    assert.equal((await sbx.commands.run('echo after-timeout')).stdout, 'after-timeout\n')
  })

  test('many concurrent commands share the pooled connections', async () => {
    const results = await Promise.all(Array.from({ length: 24 }, (_, i) =>
      sbx.commands.run(`echo job${i}`)))
    results.forEach((r, i) => assert.equal(r.stdout, `job${i}\n`))
  })

  test('large output streams completely', async () => {
    const r = await sbx.commands.run('head -c 3000000 /dev/zero | tr "\\0" a')
    assert.equal(r.stdout.length, 3_000_000)
  })

  test('a command killed while streaming leaves the sandbox usable', async () => {
    const h = await sbx.commands.run('yes', { background: true, onStdout: () => {} })
    await sleep(300)
    await h.kill()
    await assert.rejects(h.wait())
    assert.equal((await sbx.commands.run('echo still-here')).stdout, 'still-here\n')
  })
})
