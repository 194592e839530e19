// Files through the official JS SDK: every body type both ways, directory operations,
// watch, signed URLs, and error answers on connections that are then reused.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { FileType, FilesystemEventType, NotFoundError } from 'e2b'
import { createSandbox, sleep, uniqueId, waitUntil } from './helpers.mjs'

function streamOf(chunks) {
  return new ReadableStream({
    start(controller) {
      for (const c of chunks) controller.enqueue(c)
      controller.close()
    },
  })
}

async function readAll(stream) {
  const parts = []
  for await (const part of stream) parts.push(Buffer.from(part))
  return Buffer.concat(parts)
}

describe('files', () => {
  let sbx
  let dir
  before(async () => {
    sbx = await createSandbox()
    dir = `/home/user/js-${uniqueId()}`
  })
  after(async () => { await sbx?.kill() })

  test('write and read text', async () => {
    const info = await sbx.files.write(`${dir}/hello.txt`, 'hello from js\n')
    assert.equal(info.path, `${dir}/hello.txt`)
    assert.equal(info.name, 'hello.txt')
    assert.equal(info.type, FileType.FILE)
    assert.equal(await sbx.files.read(`${dir}/hello.txt`), 'hello from js\n')
    assert.equal(await sbx.files.read(`${dir}/hello.txt`, { format: 'text' }), 'hello from js\n')
  })

  test('bytes: every byte value survives both ways', async () => {
    const bytes = new Uint8Array(256 * 64).map((_, i) => i % 256)
    await sbx.files.write(`${dir}/bytes.bin`, bytes.buffer)
    const back = await sbx.files.read(`${dir}/bytes.bin`, { format: 'bytes' })
    assert.ok(back instanceof Uint8Array)
    assert.deepEqual(Buffer.from(back), Buffer.from(bytes))
    const sum = await sbx.commands.run(`sha256sum ${dir}/bytes.bin | cut -d' ' -f1`)
    const { createHash } = await import('node:crypto')
    assert.equal(sum.stdout.trim(), createHash('sha256').update(bytes).digest('hex'))
  })

  test('blob in, blob out', async () => {
    await sbx.files.write(`${dir}/blob.txt`, new Blob(['part one, ', 'part two']))
    const blob = await sbx.files.read(`${dir}/blob.txt`, { format: 'blob' })
    assert.ok(blob instanceof Blob)
    assert.equal(await blob.text(), 'part one, part two')
  })

  test('stream in, stream out (8 MiB)', async () => {
    const chunk = new Uint8Array(1 << 20).fill(0x61)
    await sbx.files.write(`${dir}/big.txt`, streamOf(Array.from({ length: 8 }, () => chunk)))
    const stream = await sbx.files.read(`${dir}/big.txt`, { format: 'stream' })
    const data = await readAll(stream)
    assert.equal(data.length, 8 << 20)
    assert.ok(data.every((b) => b === 0x61))
  })

  test('an empty file', async () => {
    await sbx.files.write(`${dir}/empty`, '')
    assert.equal(await sbx.files.read(`${dir}/empty`), '')
    assert.equal((await sbx.files.getInfo(`${dir}/empty`)).size, 0)
  })

  test('write several files in one call', async () => {
    const infos = await sbx.files.write([
      { path: `${dir}/multi/a.txt`, data: 'A' },
      { path: `${dir}/multi/b.bin`, data: new Uint8Array([1, 2, 3]).buffer },
      { path: `${dir}/multi/c.txt`, data: new Blob(['C']) },
    ])
    assert.deepEqual(infos.map((i) => i.name).sort(), ['a.txt', 'b.bin', 'c.txt'])
    assert.equal(await sbx.files.read(`${dir}/multi/a.txt`), 'A')
    assert.deepEqual([...(await sbx.files.read(`${dir}/multi/b.bin`, { format: 'bytes' }))], [1, 2, 3])
  })

  test('list, makeDir, exists, getInfo, rename, remove', async () => {
    const base = `${dir}/tree`
    assert.equal(await sbx.files.makeDir(`${base}/sub/deeper`), true)
    assert.equal(await sbx.files.makeDir(`${base}/sub/deeper`), false)
    await sbx.files.write(`${base}/top.txt`, '12345')
    await sbx.files.write(`${base}/sub/deeper/leaf.txt`, 'leaf')

    const top = await sbx.files.list(base)
    assert.deepEqual(top.map((e) => [e.name, e.type]).sort(),
      [['sub', FileType.DIR], ['top.txt', FileType.FILE]])
    const deep = await sbx.files.list(base, { depth: 3 })
    assert.ok(deep.some((e) => e.path === `${base}/sub/deeper/leaf.txt`), JSON.stringify(deep))

    const info = await sbx.files.getInfo(`${base}/top.txt`)
    assert.equal(info.size, 5)
    assert.equal(info.type, FileType.FILE)
    assert.equal(info.owner, 'user')
    assert.match(info.permissions, /^-rw/)
    assert.ok(info.modifiedTime instanceof Date)

    assert.equal(await sbx.files.exists(`${base}/top.txt`), true)
    assert.equal(await sbx.files.exists(`${base}/nope.txt`), false)

    const moved = await sbx.files.rename(`${base}/top.txt`, `${base}/moved.txt`)
    assert.equal(moved.path, `${base}/moved.txt`)
    assert.equal(await sbx.files.exists(`${base}/top.txt`), false)
    assert.equal(await sbx.files.read(`${base}/moved.txt`), '12345')

    await sbx.files.remove(`${base}/sub`)
    assert.equal(await sbx.files.exists(`${base}/sub`), false)
  })

  test('missing files are NotFoundError, and the connection keeps working', async () => {
    for (let i = 0; i < 3; i++) {
      await assert.rejects(sbx.files.read(`${dir}/missing-${i}`), NotFoundError)
      await assert.rejects(sbx.files.getInfo(`${dir}/missing-${i}`), NotFoundError)
      await assert.rejects(sbx.files.list(`${dir}/missing-dir-${i}`), NotFoundError)
      assert.equal(await sbx.files.read(`${dir}/hello.txt`), 'hello from js\n')
      assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
    }
  })

  test('watchDir sees create, write, rename and remove; stop() ends it', async () => {
    const wdir = `${dir}/watched`
    await sbx.files.makeDir(wdir)
    const events = []
    const handle = await sbx.files.watchDir(wdir, (e) => { events.push(e) })
    await sbx.files.write(`${wdir}/w.txt`, 'one')
    await sbx.commands.run(`echo more >> ${wdir}/w.txt && mv ${wdir}/w.txt ${wdir}/w2.txt && rm ${wdir}/w2.txt`)
    await waitUntil(() => events.some((e) => e.type === FilesystemEventType.REMOVE && e.name === 'w2.txt'))
    const types = new Set(events.filter((e) => e.name.startsWith('w')).map((e) => e.type))
    for (const t of [FilesystemEventType.CREATE, FilesystemEventType.WRITE,
      FilesystemEventType.RENAME, FilesystemEventType.REMOVE]) assert.ok(types.has(t), `${t}: ${[...types]}`)
    await handle.stop()
    const count = events.length
    await sbx.files.write(`${wdir}/after-stop.txt`, 'x')
    await sleep(500)
    assert.equal(events.length, count)
  })

  test('recursive watch sees files in subdirectories', async () => {
    const wdir = `${dir}/rwatched`
    await sbx.files.makeDir(`${wdir}/a/b`)
    const events = []
    const handle = await sbx.files.watchDir(wdir, (e) => { events.push(e) }, { recursive: true })
    await sbx.files.write(`${wdir}/a/b/deep.txt`, 'deep')
    await waitUntil(() => events.some((e) => e.name === 'a/b/deep.txt'))
    await handle.stop()
  })

  test('signed upload and download URLs work with plain fetch', async () => {
    const path = `${dir}/signed.txt`
    const up = await sbx.uploadUrl(path)
    const form = new FormData()
    form.append('file', new Blob(['signed upload body']), 'signed.txt')
    const resp = await fetch(up, { method: 'POST', body: form })
    assert.equal(resp.status, 200, await resp.clone().text())
    await resp.arrayBuffer()
    const down = await sbx.downloadUrl(path)
    const got = await fetch(down)
    assert.equal(got.status, 200)
    assert.equal(await got.text(), 'signed upload body')

    const head = await fetch(down, { method: 'HEAD' })
    assert.equal(head.status, 200)
    assert.equal(head.headers.get('content-length'), String('signed upload body'.length))
    const expiring = await sbx.downloadUrl(path, { useSignatureExpiration: 60 })
    assert.equal(await (await fetch(expiring)).text(), 'signed upload body')
    const tampered = down.replace('signed.txt', 'hello.txt')
    const denied = await fetch(tampered)
    assert.ok(denied.status >= 400, `tampered URL answered ${denied.status}`)
    await denied.arrayBuffer()
  })

  test('files of other users: user option', async () => {
    const info = await sbx.files.write('/root/js-root.txt', 'root only', { user: 'root' })
    assert.equal(info.path, '/root/js-root.txt')
    assert.equal(await sbx.files.read('/root/js-root.txt', { user: 'root' }), 'root only')
  })
})
