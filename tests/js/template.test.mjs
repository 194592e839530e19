// Template builds through the official JS SDK's Template builder: steps, COPY from the
// build context, envs, workdir, user, a start command with a ready check; then sandboxes
// from the template.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Sandbox, Template, waitForPort } from 'e2b'
import { uniqueId } from './helpers.mjs'

describe('templates', () => {
  const ctx = mkdtempSync(join(tmpdir(), 'aenv-js-ctx-'))
  const made = []
  after(async () => {
    await Promise.all(made.map((s) => s.kill().catch(() => {})))
    rmSync(ctx, { recursive: true, force: true })
  })

  test('Template.build from base, then sandboxes from the template', async () => {
    writeFileSync(join(ctx, 'hello.txt'), 'hello from the build context\n')
    mkdirSync(join(ctx, 'app', 'lib'), { recursive: true })
    writeFileSync(join(ctx, 'app', 'main.py'), "print('main')\n")
    writeFileSync(join(ctx, 'app', 'lib', 'util.py'), 'X = 1\n')
    const name = `js-built-${uniqueId()}`
    const template = Template({ fileContextPath: ctx })
      .fromTemplate('base')
      .runCmd('useradd -m -s /bin/bash builder', { user: 'root' })
      .setUser('builder')
      .setWorkdir('/srv/app')
      .copy('hello.txt', '/srv/app/')
      .copy('app', '/srv/app/code')
      .setEnvs({ GREETING: 'hi there' })
      .runCmd('echo "$GREETING from $(whoami) in $(pwd)" > built.txt')
      .setStartCmd('exec python3 -m http.server 8123', waitForPort(8123))
    const logs = []
    const build = await Template.build(template, name, { onBuildLogs: (entry) => logs.push(String(entry)) })
    assert.ok(build.templateId, JSON.stringify(build))
    assert.ok(logs.length > 0)
    assert.equal(await Template.exists(name), true)

    const sbx = await Sandbox.create(name, { timeoutMs: 120_000 })
    made.push(sbx)
    assert.equal(await sbx.files.read('/srv/app/built.txt'), 'hi there from builder in /srv/app\n')
    assert.equal(await sbx.files.read('/srv/app/hello.txt'), 'hello from the build context\n')
    assert.equal(await sbx.files.read('/srv/app/code/lib/util.py'), 'X = 1\n')
    const r = await sbx.commands.run('curl -s http://127.0.0.1:8123/built.txt; whoami; pwd')
    assert.equal(r.stdout, 'hi there from builder in /srv/app\nbuilder\n/srv/app\n')
    // the started server answers through the proxy's host route as well
    const url = `${process.env.E2B_SANDBOX_URL}/built.txt`
    const resp = await fetch(url, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8123' } })
    assert.equal(resp.status, 200)
    assert.equal(await resp.text(), 'hi there from builder in /srv/app\n')
  })

  test('a failing step fails the build with its output', async () => {
    const template = Template().fromTemplate('base').runCmd('echo about-to-fail; exit 7')
    await assert.rejects(Template.build(template, `js-broken-${uniqueId()}`), (err) => {
      assert.match(String(err), /exit|7|fail/i)
      return true
    })
  })
})
