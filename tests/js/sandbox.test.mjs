// The sandbox lifecycle through the official JS SDK: list (filters, pagination), getInfo,
// setTimeout, pause and connect, fork, snapshots, metrics, kill.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { createSandbox, uniqueId } from './helpers.mjs'

async function listAll(opts) {
  const paginator = Sandbox.list(opts)
  const pages = []
  while (paginator.hasNext) pages.push(await paginator.nextItems())
  return pages
}

describe('sandbox lifecycle', () => {
  const run = uniqueId()
  const made = []
  async function make(extra = {}) {
    const s = await createSandbox({ ...extra, metadata: { run, ...(extra.metadata ?? {}) } })
    made.push(s)
    return s
  }
  after(async () => { await Promise.all(made.map((s) => s.kill().catch(() => {}))) })

  test('create with metadata and envs; getInfo; isRunning', async () => {
    const sbx = await make({ metadata: { role: 'info' }, envs: { FROM_CREATE: 'yes' } })
    assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.equal(info.state, 'running')
    assert.deepEqual(info.metadata, { suite: 'js', run, role: 'info' })
    assert.ok(info.startedAt instanceof Date && info.endAt > info.startedAt)
    assert.ok(info.cpuCount >= 1 && info.memoryMB >= 128)
    assert.ok(info.envdVersion)
    assert.deepEqual(await Sandbox.getInfo(sbx.sandboxId), info)
    assert.equal(await sbx.isRunning(), true)
    assert.equal((await sbx.commands.run('echo $FROM_CREATE')).stdout, 'yes\n')
  })

  test('list: metadata filter, state filter, pagination', async () => {
    await Promise.all([0, 1, 2].map((i) => make({ metadata: { role: 'listed', index: String(i) } })))
    const pages = await listAll({ query: { metadata: { run, role: 'listed' } }, limit: 2 })
    assert.deepEqual(pages.map((p) => p.length), [2, 1])
    const ids = pages.flat().map((s) => s.sandboxId)
    assert.equal(new Set(ids).size, 3)
    for (const s of pages.flat()) {
      assert.equal(s.metadata.role, 'listed')
      assert.equal(s.state, 'running')
    }
    const one = await listAll({ query: { metadata: { run, role: 'listed', index: '1' } } })
    assert.equal(one.flat().length, 1)
    assert.equal((await listAll({ query: { metadata: { run, role: 'listed' }, state: ['paused'] } })).flat().length, 0)
    assert.equal((await listAll({ query: { metadata: { run: 'no-such-run' } } })).flat().length, 0)
  })

  test('setTimeout moves endAt', async () => {
    const sbx = await make()
    await sbx.setTimeout(30_000)
    const soon = (await sbx.getInfo()).endAt.getTime() - Date.now()
    assert.ok(soon > 20_000 && soon <= 31_000, `endAt in ${soon} ms`)
    await Sandbox.setTimeout(sbx.sandboxId, 300_000)
    const later = (await sbx.getInfo()).endAt.getTime() - Date.now()
    assert.ok(later > 290_000, `endAt in ${later} ms`)
  })

  test('pause, list as paused, connect resumes with files and processes', async () => {
    const sbx = await make({ metadata: { role: 'paused' } })
    await sbx.files.write('/home/user/kept.txt', 'kept across pause')
    const bg = await sbx.commands.run('python3 -c "import time\nn=0\nwhile True:\n  n+=1; open(\'/home/user/n\',\'w\').write(str(n)); time.sleep(0.05)"', { background: true })
    await bg.disconnect()
    assert.ok((await sbx.commands.list()).some((p) => p.pid === bg.pid), 'the process runs before the pause')
    assert.equal(await sbx.pause(), true)
    const listed = await listAll({ query: { metadata: { run, role: 'paused' } } })
    assert.equal(listed.flat()[0].state, 'paused')
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal((await again.getInfo()).state, 'running')
    assert.equal(await again.files.read('/home/user/kept.txt'), 'kept across pause')
    const procs = await again.commands.list()
    assert.ok(procs.some((p) => p.pid === bg.pid), JSON.stringify(procs))
    await again.pause()
    await sbx.connect()  // the instance method resumes too
    assert.equal(await sbx.isRunning(), true)
  })

  test('fork: children inherit files and stay independent', async () => {
    const parent = await make({ metadata: { role: 'fork-parent' } })
    await parent.files.write('/home/user/setup.txt', 'expensive setup')
    const results = await parent.fork({ count: 2 })
    const children = results.filter((r) => r instanceof Sandbox)
    made.push(...children)
    assert.equal(children.length, 2, results.filter((r) => !(r instanceof Sandbox)).map(String).join('; '))
    assert.equal(new Set(children.map((c) => c.sandboxId)).size, 2)
    for (const c of children) {
      assert.notEqual(c.sandboxId, parent.sandboxId)
      assert.equal(await c.files.read('/home/user/setup.txt'), 'expensive setup')
    }
    await children[0].files.write('/home/user/only-here.txt', 'x')
    assert.equal(await children[1].files.exists('/home/user/only-here.txt'), false)
    assert.equal(await parent.files.exists('/home/user/only-here.txt'), false)
    const statics = await Sandbox.fork(parent.sandboxId, { count: 1 })
    assert.ok(statics[0] instanceof Sandbox, String(statics[0]))
    made.push(statics[0])
    assert.equal(await statics[0].files.read('/home/user/setup.txt'), 'expensive setup')
  })

  test('createSnapshot, create from it, listSnapshots, deleteSnapshot', async () => {
    const src = await make()
    await src.files.write('/home/user/snap.txt', 'in the snapshot')
    const snap = await src.createSnapshot({ name: `js-snap-${run}` })
    assert.ok(snap.snapshotId)
    const fromSnap = await make({ template: snap.snapshotId })
    assert.equal(await fromSnap.files.read('/home/user/snap.txt'), 'in the snapshot')
    const byName = await Sandbox.create(`js-snap-${run}`, { timeoutMs: 120_000 })
    made.push(byName)
    assert.equal(await byName.files.read('/home/user/snap.txt'), 'in the snapshot')

    const paginator = src.listSnapshots()
    const snaps = []
    while (paginator.hasNext) snaps.push(...(await paginator.nextItems()))
    assert.ok(snaps.some((s) => s.snapshotId === snap.snapshotId), JSON.stringify(snaps))
    await byName.kill()
    await fromSnap.kill()
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  })

  test('getMetrics', async () => {
    const sbx = await make()
    await sbx.commands.run('sleep 1.2')
    const metrics = await sbx.getMetrics()
    assert.ok(Array.isArray(metrics))
    if (metrics.length) assert.ok(metrics[0].memTotal > 0, JSON.stringify(metrics[0]))
  })

  test('kill: instance and static; a killed sandbox is gone', async () => {
    const a = await make()
    const b = await make()
    assert.equal(await a.kill(), true)
    assert.equal(await Sandbox.kill(b.sandboxId), true)
    assert.equal(await Sandbox.kill(b.sandboxId), false)
    assert.equal(await a.isRunning().catch(() => false), false)
    await assert.rejects(Sandbox.connect(a.sandboxId))
  })
})
