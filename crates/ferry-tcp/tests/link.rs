//! The TCP transport on its own, without the engine: a `TcpServer` over a region table and a
//! `TcpLink` dialed to it, as two engines' halves in one process. WRITEs and READs land byte for
//! byte over one stream and several, a refused operation fails by name and changes nothing at the
//! target, notifications reach the target's notifier intact and in order, and a batch its caller
//! drops leaves nothing on the link.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{LEN, T, bytes, pair, pair_with, pattern};
use ferry_core::{
    Access, DataLink, DeviceCopies, DmaView, Error, MemoryBlock, Notification, Op, OwnedBuffer, RegionEntry, RegionKey,
    Result,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_land_byte_for_byte_over_every_stream_count() {
    for streams in [1, 4] {
        let p = pair(streams).await;
        let src = pattern(streams as u8);
        p.local.copy_in(0, &src).unwrap();
        // Scattered ranges of every size class: tiny, mid, and one over a frame's usual payload.
        let ranges: Vec<(u64, u64)> = vec![
            (0, 1),
            (7, 4096),
            (8192, 64 << 10),
            (200 << 10, 600 << 10),
            (LEN as u64 - 3, 3),
        ];
        p.run(p.request(Op::Write, &ranges)).await.unwrap();
        let at_target = bytes(&p.remote);
        for &(o, n) in &ranges {
            let (o, n) = (o as usize, n as usize);
            assert_eq!(
                at_target[o..o + n],
                src[o..o + n],
                "{streams} streams: write at {o}+{n}"
            );
        }
        assert!(
            at_target[1..7].iter().all(|&b| b == 0),
            "nothing outside the ranges is written"
        );

        // Read it all back into a cleared local region.
        p.local.copy_in(0, &vec![0u8; LEN]).unwrap();
        p.run(p.request(Op::Read, &[(0, LEN as u64)])).await.unwrap();
        assert_eq!(bytes(&p.local), at_target, "{streams} streams: read back");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_target_refuses_fails_by_name_and_writes_nothing() {
    let p = pair(2).await;
    p.local.copy_in(0, &pattern(9)).unwrap();
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    // Past the end of the target's region: the target checks every range itself.
    request.items[0].remote_offset = LEN as u64 - 100;
    request.items[0].remote_addr = p.remote.addr() + LEN as u64 - 100;
    let err = p.run(request).await.unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    // A region the target does not have.
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    request.items[0].remote_key = RegionKey(0xdead);
    let err = p.run(request).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("no region")),
        "{err:?}"
    );
    assert!(
        bytes(&p.remote).iter().all(|&b| b == 0),
        "a refused operation wrote nothing"
    );
    // The link goes on.
    p.run(p.request(Op::Write, &[(0, 4096)])).await.unwrap();
    assert_eq!(bytes(&p.remote)[..4096], pattern(9)[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_the_targets_notifier_intact_and_in_order() {
    let p = pair(4).await;
    let long = "x".repeat(1024);
    for round in 0..8u64 {
        let msg = if round == 7 { long.clone() } else { round.to_string() };
        tokio::time::timeout(T, p.link.notify(Notification::new(format!("n{round}"), msg)))
            .await
            .unwrap()
            .unwrap();
    }
    let seen = p.inbox.seen.lock().unwrap();
    assert_eq!(seen.len(), 8, "each notification is queued once it is acknowledged");
    for (round, (n, _)) in seen.iter().enumerate() {
        assert_eq!(n.name, format!("n{round}"), "in the order sent");
        assert_eq!(n.msg, if round == 7 { long.clone() } else { round.to_string() });
    }
}

/// A block whose peer reads wait at a gate first (its `prepare_read` hook, which the target runs
/// before it sends a read's data): a target that stops answering until the test opens it.
struct Gated {
    bytes: OwnedBuffer,
    open: Arc<(Mutex<bool>, Condvar)>,
}

// SAFETY: every promise is `OwnedBuffer`'s, whose pointer and length this block hands on unchanged;
// the gate only delays the hook.
unsafe impl MemoryBlock for Gated {
    fn as_ptr(&self) -> *mut u8 {
        self.bytes.as_ptr()
    }
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn kind(&self) -> &str {
        "gated host"
    }
    /// Staged, as device memory behind a host copy is: its hooks may block, so the target runs them
    /// off its runtime's threads.
    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }
    fn prepare_read(&self, _: usize, _: usize) -> Result<()> {
        let (open, opened) = &*self.open;
        let guard = open.lock().unwrap();
        let (_guard, waited) = opened.wait_timeout_while(guard, T, |open| !*open).unwrap();
        assert!(!waited.timed_out(), "the test never opened the gate");
        Ok(())
    }
}

/// The caller bounds a batch by dropping it, and the link keeps nothing of it: its operation is
/// taken back at the drop (not when an answer comes, which may be never), the answer that comes
/// late is discarded (the dropped read's buffer is never written) and the link serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_leaves_nothing_waiting_and_its_late_answer_lands_nowhere() {
    let open = Arc::new((Mutex::new(false), Condvar::new()));
    let block = Gated {
        bytes: OwnedBuffer::new(pattern(3)),
        open: open.clone(),
    };
    let remote = Arc::new(RegionEntry::new(RegionKey(0x51), Access::READ_WRITE, Arc::new(block)).unwrap());
    let p = pair_with(remote, 1).await;
    assert_eq!(p.link.waiting_operations(), 0);

    let mut stalled = p.link.transfer(p.request(Op::Read, &[(0, 4096)]));
    let gave_up = tokio::time::timeout(Duration::from_millis(300), &mut stalled).await;
    assert!(
        gave_up.is_err(),
        "the target answered a read it was holding: {gave_up:?}"
    );
    assert_eq!(
        p.link.waiting_operations(),
        1,
        "the read waits while its batch is alive"
    );
    drop(stalled);
    assert_eq!(p.link.waiting_operations(), 0, "the dropped batch took its read back");

    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    // Behind the stalled read on the link's one stream: once this one is answered, the late data
    // came and went.
    p.run(p.request(Op::Read, &[(8192, 4096)])).await.unwrap();
    let local = bytes(&p.local);
    assert_eq!(local[8192..12288], pattern(3)[8192..12288]);
    assert!(local[..4096].iter().all(|&b| b == 0), "the dropped read's data landed");
    assert_eq!(p.link.waiting_operations(), 0);
}

/// Device memory behind a host copy, emulated: the "device" is a second buffer that only the
/// block's hooks reach, as a GPU's memory is reached only by its copies. Each hook call's range is
/// recorded; the first copy to the device also records whether the write's last byte had arrived
/// in the host copy by then; a copy from the device can be made to fail at its `n`th call.
struct Device {
    mirror: OwnedBuffer,
    device: Mutex<Vec<u8>>,
    commits: Mutex<Vec<(usize, usize)>>,
    prepares: Mutex<Vec<(usize, usize)>>,
    last_byte_in_at_first_commit: Mutex<Option<bool>>,
    fail_prepare_at: Option<usize>,
    prepare_calls: std::sync::atomic::AtomicUsize,
    /// Whether it also copies between the device and any buffer (`MemoryBlock::device_copies`),
    /// as CUDA memory does, or only between the device and its host copy.
    any_buffer: bool,
}

impl Device {
    fn new(len: usize, fail_prepare_at: Option<usize>, any_buffer: bool) -> Self {
        Device {
            any_buffer,
            mirror: OwnedBuffer::new(vec![0u8; len]),
            device: Mutex::new(vec![0u8; len]),
            commits: Mutex::new(Vec::new()),
            prepares: Mutex::new(Vec::new()),
            last_byte_in_at_first_commit: Mutex::new(None),
            fail_prepare_at,
            prepare_calls: Default::default(),
        }
    }
}

// SAFETY: every promise about the host copy is `OwnedBuffer`'s, whose pointer and length this
// block hands on unchanged; the hooks copy within its bounds (the transport checked the ranges).
unsafe impl MemoryBlock for Device {
    fn as_ptr(&self) -> *mut u8 {
        self.mirror.as_ptr()
    }
    fn len(&self) -> usize {
        self.mirror.len()
    }
    fn kind(&self) -> &str {
        "emulated device (staged)"
    }
    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }
    fn commit_written(&self, offset: usize, len: usize, _: ferry_core::Durability) -> Result<()> {
        let last = self.len() - 1;
        // SAFETY: `last` and `offset..offset + len` lie in the host copy; nothing holds a Rust
        // reference to its bytes.
        unsafe {
            self.last_byte_in_at_first_commit
                .lock()
                .unwrap()
                .get_or_insert(self.as_ptr().add(last).read() != 0);
            let written = std::slice::from_raw_parts(self.as_ptr().add(offset), len);
            self.device.lock().unwrap()[offset..offset + len].copy_from_slice(written);
        }
        self.commits.lock().unwrap().push((offset, len));
        Ok(())
    }
    fn prepare_read(&self, offset: usize, len: usize) -> Result<()> {
        self.counted_prepare(offset, len)?;
        let device = self.device.lock().unwrap();
        // SAFETY: `offset..offset + len` lies in the host copy; nothing holds a Rust reference to
        // its bytes.
        unsafe { std::ptr::copy_nonoverlapping(device[offset..].as_ptr(), self.as_ptr().add(offset), len) };
        Ok(())
    }
    fn device_copies(&self) -> Option<&dyn DeviceCopies> {
        self.any_buffer.then_some(self as &dyn DeviceCopies)
    }
}

impl Device {
    /// Counts a copy from the device, failing the one asked to fail.
    fn counted_prepare(&self, offset: usize, len: usize) -> Result<()> {
        let call = self.prepare_calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.fail_prepare_at == Some(call) {
            return Err(Error::Internal("the emulated device's copy failed".into()));
        }
        self.prepares.lock().unwrap().push((offset, len));
        Ok(())
    }

    /// Whether the host copy is all zeros: nothing ever went through it.
    fn host_copy_untouched(&self) -> bool {
        // SAFETY: the host copy's bytes, read while no transfer runs.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
            .iter()
            .all(|&b| b == 0)
    }
}

impl DeviceCopies for Device {
    fn copy_to_device(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.device.lock().unwrap()[offset..offset + src.len()].copy_from_slice(src);
        self.commits.lock().unwrap().push((offset, src.len()));
        Ok(())
    }
    fn copy_from_device(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.counted_prepare(offset, dst.len())?;
        dst.copy_from_slice(&self.device.lock().unwrap()[offset..offset + dst.len()]);
        Ok(())
    }
    unsafe fn copy_raw(&self, _: &[ferry_core::RawCopy]) -> Result<()> {
        unreachable!("a TCP link copies through buffers of its own")
    }
}

const DEVICE_LEN: usize = 16 << 20;

/// A pair whose target serves an emulated [`Device`] of [`DEVICE_LEN`] bytes, the local region as
/// long, over one stream: a descriptor of the whole region is one request, of four pieces.
async fn device_pair(fail_prepare_at: Option<usize>, any_buffer: bool) -> (common::Pair, Arc<Device>) {
    let device = Arc::new(Device::new(DEVICE_LEN, fail_prepare_at, any_buffer));
    let remote = Arc::new(RegionEntry::new(RegionKey(0x51), Access::READ_WRITE, device.clone()).unwrap());
    let mut p = pair_with(remote, 1).await;
    let local: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; DEVICE_LEN]));
    p.local = Arc::new(RegionEntry::new(RegionKey(0x11), Access::READ_WRITE, local).unwrap());
    (p, device)
}

/// Bytes none of which is zero, so that a zero says "not arrived".
fn nonzero(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + seed) % 251) as u8 + 1).collect()
}

/// `ranges` sorted tile `[0, len)`: every byte in exactly one.
fn tiles(mut ranges: Vec<(usize, usize)>, len: usize) -> bool {
    ranges.sort();
    let mut at = 0;
    for (offset, n) in ranges {
        if offset != at {
            return false;
        }
        at += n;
    }
    at == len
}

/// Writes the whole region from the local one: every byte reaches the device, each copied there
/// once, in more than one copy.
async fn write_whole_region(p: &common::Pair, device: &Device, seed: usize) {
    let src = nonzero(DEVICE_LEN, seed);
    p.local.copy_in(0, &src).unwrap();
    p.run(p.request(Op::Write, &[(0, DEVICE_LEN as u64)])).await.unwrap();
    assert!(*device.device.lock().unwrap() == src, "every byte is on the device");
    let commits = device.commits.lock().unwrap().clone();
    assert!(commits.len() > 1, "one copy for the whole write: {commits:?}");
    assert!(tiles(commits, DEVICE_LEN), "each byte copied to the device once");
}

/// A large write into staged memory is copied to the device piece by piece while the rest of its
/// payload still arrives: the first copy ran before the last byte had come, every byte reached the
/// device exactly once, and the write completed only after the last copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_write_into_staged_memory_overlaps_its_device_copies_with_the_network() {
    let (p, device) = device_pair(None, false).await;
    write_whole_region(&p, &device, 3).await;
    assert_eq!(
        *device.last_byte_in_at_first_commit.lock().unwrap(),
        Some(false),
        "the first copy to the device waited for the whole payload"
    );
}

/// A large read of staged memory sends each piece once its copy from the device is made, the next
/// piece's copy running meanwhile: what arrives is the device's bytes, every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_read_of_staged_memory_sends_the_devices_bytes_piece_by_piece() {
    let (p, device) = device_pair(None, false).await;
    let on_device = nonzero(DEVICE_LEN, 5);
    device.device.lock().unwrap().copy_from_slice(&on_device);
    p.run(p.request(Op::Read, &[(0, DEVICE_LEN as u64)])).await.unwrap();
    let mut got = vec![0u8; DEVICE_LEN];
    p.local.copy_out(0, &mut got).unwrap();
    assert!(got == on_device, "the read carried the device's bytes");
    let prepares = device.prepares.lock().unwrap().clone();
    assert!(prepares.len() > 1, "one copy for the whole read: {prepares:?}");
    assert!(tiles(prepares, DEVICE_LEN), "each byte copied from the device once");
}

/// A copy from the device that fails fails the read, whether it was the first piece's (before any
/// byte was sent) or a later one's (after the header went out), through the host copy or past it,
/// and the link serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_copy_fails_the_read_before_or_after_its_first_byte() {
    for (fail_at, any_buffer) in [(0, false), (3, false), (0, true), (3, true)] {
        let (p, device) = device_pair(Some(fail_at), any_buffer).await;
        device.device.lock().unwrap().copy_from_slice(&nonzero(DEVICE_LEN, 1));
        let err = p.run(p.request(Op::Read, &[(0, DEVICE_LEN as u64)])).await.unwrap_err();
        match fail_at {
            0 => assert!(matches!(&err, Error::Internal(m) if m.contains("emulated")), "{err:?}"),
            _ => assert!(matches!(err, Error::Io { .. }), "{err:?}"),
        }
        // The stream is still in step: a small read goes through.
        p.run(p.request(Op::Read, &[(0, 4096)])).await.unwrap();
        let mut got = vec![0u8; 4096];
        p.local.copy_out(0, &mut got).unwrap();
        assert_eq!(
            got,
            nonzero(DEVICE_LEN, 1)[..4096],
            "fail at {fail_at}, any buffer: {any_buffer}"
        );
    }
}

/// Memory whose device copies to and from any buffer (CUDA's) is moved by the target through its
/// stream's own buffers, large requests and small, in pieces: every byte reaches the device, or
/// comes from it, and the host copy in front of the device is never touched, so that it costs no
/// memory however large the region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_device_copies_from_any_buffer_never_goes_through_its_host_copy() {
    let (p, device) = device_pair(None, true).await;
    write_whole_region(&p, &device, 9).await;

    // A small write, and reads large and small, of what the device holds.
    p.local.copy_in(4096, &[0xee; 4096]).unwrap();
    p.run(p.request(Op::Write, &[(4096, 4096)])).await.unwrap();
    assert_eq!(device.device.lock().unwrap()[4096..8192], [0xee; 4096]);
    let on_device = nonzero(DEVICE_LEN, 11);
    device.device.lock().unwrap().copy_from_slice(&on_device);
    p.local.copy_in(0, &vec![0u8; DEVICE_LEN]).unwrap();
    p.run(p.request(Op::Read, &[(0, DEVICE_LEN as u64)])).await.unwrap();
    let mut got = vec![0u8; DEVICE_LEN];
    p.local.copy_out(0, &mut got).unwrap();
    assert!(got == on_device, "the read carried the device's bytes");
    p.run(p.request(Op::Read, &[(100, 10)])).await.unwrap();
    // Checked ones: the target sums what the device holds.
    for op in [Op::Write, Op::Read] {
        let mut checked = p.request(op, &[(0, DEVICE_LEN as u64), (8192, 100)]);
        checked.checked = true;
        p.run(checked).await.unwrap();
    }
    assert!(device.host_copy_untouched(), "a byte went through the host copy");
}

/// One coalesced frame whose parts are memory a device copies from any buffer (CUDA's), staged
/// memory without such copies (Vulkan's) and host memory: the target moves the whole payload
/// through its stream's buffers, so that the first device's host copy is never touched, while the
/// staged block's host copy is committed to its device after a write and brought from it before a
/// read. Checked transfers too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_mixing_device_staged_and_host_memory_keeps_each_on_its_own_path() {
    const N: u64 = 16 << 10;
    let cuda = Arc::new(Device::new(LEN, None, true));
    let staged = Arc::new(Device::new(LEN, None, false));
    let remotes = [
        Arc::new(RegionEntry::new(RegionKey(0x51), Access::READ_WRITE, cuda.clone()).unwrap()),
        Arc::new(RegionEntry::new(RegionKey(0x52), Access::READ_WRITE, staged.clone()).unwrap()),
        common::region(0x53, 0),
    ];
    let pool = ferry_tcp::CoalescePool::new("2:1".parse().unwrap());
    let p = common::pair_serving(&remotes, 1, pool).await;
    let items = |op| {
        (0..3)
            .map(|k| p.item(op, k as u64 * N, &remotes[k], 0, N))
            .collect::<Vec<_>>()
    };
    for checked in [false, true] {
        let src = nonzero(3 * N as usize, 30 + checked as usize);
        p.local.copy_in(0, &src).unwrap();
        let mut write = p.request_of(Op::Write, items(Op::Write));
        write.checked = checked;
        p.run(write).await.unwrap();
        let n = N as usize;
        assert_eq!(cuda.device.lock().unwrap()[..n], src[..n], "checked: {checked}");
        assert_eq!(
            staged.device.lock().unwrap()[..n],
            src[n..2 * n],
            "staged not committed"
        );
        let mut at_host = vec![0u8; n];
        remotes[2].copy_out(0, &mut at_host).unwrap();
        assert_eq!(at_host, src[2 * n..]);

        let on_device = nonzero(3 * n, 40 + checked as usize);
        cuda.device.lock().unwrap()[..n].copy_from_slice(&on_device[..n]);
        staged.device.lock().unwrap()[..n].copy_from_slice(&on_device[n..2 * n]);
        remotes[2].copy_in(0, &on_device[2 * n..]).unwrap();
        p.local.copy_in(0, &vec![0u8; 3 * n]).unwrap();
        let mut read = p.request_of(Op::Read, items(Op::Read));
        read.checked = checked;
        p.run(read).await.unwrap();
        let mut got = vec![0u8; 3 * n];
        p.local.copy_out(0, &mut got).unwrap();
        assert!(
            got == on_device,
            "the read carried each memory's bytes (checked: {checked})"
        );
    }
    assert!(cuda.host_copy_untouched(), "a byte went through the device's host copy");
}

/// A pair whose initiator's own region is an emulated [`Device`] of [`DEVICE_LEN`] bytes whose
/// device copies from any buffer, the target's host memory as long, over one stream.
async fn initiator_device_pair(fail_prepare_at: Option<usize>) -> (common::Pair, Arc<Device>) {
    let remote: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; DEVICE_LEN]));
    let remote = Arc::new(RegionEntry::new(RegionKey(0x51), Access::READ_WRITE, remote).unwrap());
    let mut p = pair_with(remote, 1).await;
    let device = Arc::new(Device::new(DEVICE_LEN, fail_prepare_at, true));
    p.local = Arc::new(RegionEntry::new(RegionKey(0x11), Access::READ_WRITE, device.clone()).unwrap());
    (p, device)
}

/// An initiator's own memory whose device copies to and from any buffer (CUDA's) goes out of and
/// lands in the device through the link's stream buffers, piece by piece, checked transfers too:
/// every byte arrives, each copied once, and the host copy in front of the device is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiators_device_memory_moves_piece_by_piece_never_through_its_host_copy() {
    let (p, device) = initiator_device_pair(None).await;
    let whole = [(0, DEVICE_LEN as u64)];
    for checked in [false, true] {
        let seed = 20 + checked as usize;
        let on_device = nonzero(DEVICE_LEN, seed);
        device.device.lock().unwrap().copy_from_slice(&on_device);
        device.prepares.lock().unwrap().clear();
        let mut write = p.request(Op::Write, &whole);
        write.checked = checked;
        p.run(write).await.unwrap();
        let mut at_target = vec![0u8; DEVICE_LEN];
        p.remote.copy_out(0, &mut at_target).unwrap();
        assert!(
            at_target == on_device,
            "the write carried the device's bytes (checked: {checked})"
        );
        let prepares = device.prepares.lock().unwrap().clone();
        assert!(
            prepares.len() > 1,
            "one copy from the device for the whole write: {prepares:?}"
        );
        assert!(tiles(prepares, DEVICE_LEN), "each byte copied from the device once");

        let at_target = nonzero(DEVICE_LEN, seed + 10);
        p.remote.copy_in(0, &at_target).unwrap();
        device.commits.lock().unwrap().clear();
        let mut read = p.request(Op::Read, &whole);
        read.checked = checked;
        p.run(read).await.unwrap();
        assert!(
            *device.device.lock().unwrap() == at_target,
            "the read landed on the device (checked: {checked})"
        );
        let commits = device.commits.lock().unwrap().clone();
        assert!(
            commits.len() > 1,
            "one copy to the device for the whole read: {commits:?}"
        );
        assert!(tiles(commits, DEVICE_LEN), "each byte copied to the device once");
    }
    // Small ones, inline-sized, take the same way.
    device.device.lock().unwrap()[..64].fill(0xab);
    p.run(p.request(Op::Write, &[(0, 64)])).await.unwrap();
    let mut got = [0u8; 64];
    p.remote.copy_out(0, &mut got).unwrap();
    assert_eq!(got, [0xab; 64]);
    p.remote.copy_in(64, &[0xcd; 64]).unwrap();
    p.run(p.request(Op::Read, &[(64, 64)])).await.unwrap();
    assert_eq!(device.device.lock().unwrap()[64..128], [0xcd; 64]);
    assert!(device.host_copy_untouched(), "a byte went through the host copy");
}

/// A copy from the initiator's device that fails fails the write by the device's error: the first
/// piece's before any byte of the frame left (the target's memory keeps what it held), a later
/// one's after, with the rest of the payload sent as zeros; either way the stream stays in step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_from_the_initiators_device_fails_the_write() {
    for fail_at in [0, 2] {
        let (p, device) = initiator_device_pair(Some(fail_at)).await;
        device.device.lock().unwrap().copy_from_slice(&nonzero(DEVICE_LEN, 4));
        p.remote.copy_in(0, &vec![0x5a; DEVICE_LEN]).unwrap();
        let err = p
            .run(p.request(Op::Write, &[(0, DEVICE_LEN as u64)]))
            .await
            .unwrap_err();
        assert!(matches!(&err, Error::Internal(m) if m.contains("emulated")), "{err:?}");
        let mut at_target = vec![0u8; DEVICE_LEN];
        p.remote.copy_out(0, &mut at_target).unwrap();
        if fail_at == 0 {
            assert!(
                at_target.iter().all(|&b| b == 0x5a),
                "a write that sent nothing changed the target"
            );
        }
        // The stream is still in step: a small write goes through.
        p.run(p.request(Op::Write, &[(0, 4096)])).await.unwrap();
        p.remote.copy_out(0, &mut at_target[..4096]).unwrap();
        assert_eq!(at_target[..4096], nonzero(DEVICE_LEN, 4)[..4096], "fail at {fail_at}");
    }
}
