//! Shared-memory landing slots: how a prefill worker on the same host puts a handoff straight
//! into the decode worker's memory, without a socket in between.
//!
//! The decode worker owns a [`LandingArena`]: one POSIX shared-memory file (`/dev/shm`),
//! its pages reserved up front (`posix_fallocate`, so a full tmpfs fails at start-up rather
//! than as a `SIGBUS` later), mapped once. Each reservation that may receive KV takes a
//! [`LandingSlot`] of it and advertises a [`Landing`] descriptor in its KV target. A prefill
//! worker that can open the same file (same host, same `/dev/shm`, and the file's nonce
//! matches the descriptor's) copies the handoff into the slot with a [`LandingWriter`] and then
//! sends only a short completion record over the transport; any other prefill worker sends
//! the whole handoff as before. Either way the decode side parses and verifies the same bytes
//! (header, manifest checksum, per-segment checksums, epoch), so what reaches the batch is
//! checked identically.
//!
//! Fencing. Every slot has a fence word in the arena's fence table: the decode side sets it
//! to a fresh random token when it hands the slot to a reservation (the token travels in the
//! descriptor) and clears it the moment the reservation lets go (lease expired, request
//! cancelled, KV consumed). A writer first claims the slot by swapping the token for its
//! claimed form ([`claimed`]) in one compare-and-swap, and copies only if that succeeded: a
//! prefill that outlived its reservation writes nothing, however long its lease was extended
//! or however early the reservation was cancelled, and no two writers share a slot. A writer
//! that claimed the slot just before the reservation let go may still be copying, so a slot
//! released without its KV landing is quarantined (30 s, longer than a push may take) before
//! it is handed out again. A slot whose KV did land was written by a writer that has finished
//! (the completion record is sent after the copy), so it is reused at once.

// Mapping shared memory needs `unsafe` (mmap, raw copies); every block says why it holds.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Bytes at the start of the arena that hold its header (magic, nonce, length, where the
/// fence table and the slots start); the fence table and then the slots follow.
const HEADER_BYTES: usize = 4096;
/// Header fields (byte offsets).
const AT_MAGIC: usize = 0;
const AT_NONCE: usize = 8;
const AT_LEN: usize = 16;
const AT_FENCES: usize = 24;
const AT_SLOTS: usize = 32;
/// Slots start and end on this boundary.
const SLOT_ALIGN: usize = 4096;
const MAGIC: u64 = 0x4c44_4e41_4b44_4e54; // "TNDKANDL"
/// Prefix of every arena's file name in /dev/shm: `tandem-kv-<pid>-<nonce>`.
const NAME_PREFIX: &str = "tandem-kv-";
/// How long a slot released without its KV landing waits before it is reused.
pub const DEFAULT_QUARANTINE: Duration = Duration::from_secs(30);
/// Bytes of /dev/shm an arena leaves free for other users.
const SHM_HEADROOM: usize = 16 << 20;
/// Arenas a writer keeps mapped (one per decode worker it sends to).
const WRITER_CACHE: usize = 16;

/// Where a reservation's handoff may be written: everything a writer needs, as it travels in
/// the KV target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Landing {
    /// The arena's file name in /dev/shm.
    pub name: String,
    /// The arena's random nonce (also in its header): a file of the same name on another host
    /// or from another incarnation does not match.
    pub nonce: u64,
    /// The arena's length in bytes.
    pub arena_len: u64,
    /// The slot's offset in the arena.
    pub offset: u64,
    /// The slot's capacity in bytes.
    pub capacity: u64,
    /// The token the slot's fence holds while its reservation waits for this KV.
    pub fence: u64,
    /// The slot's fence word's offset in the arena.
    pub fence_offset: u64,
    /// The arena as registered with the decode worker's transport, for writers that cannot
    /// map it (another host): they claim and fill the slot with one-sided UCX operations.
    pub remote: Option<RemoteArena>,
}

/// A landing arena registered for one-sided writes (`ucp_mem_map`) by the decode worker's
/// transport: its packed remote key and the address the arena is mapped at there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteArena {
    /// The packed remote key.
    pub rkey: Vec<u8>,
    /// The arena's first byte in the decode worker's address space.
    pub base: u64,
}

/// Why a landing write did not happen (the caller falls back to sending the handoff).
#[derive(Debug, thiserror::Error)]
pub enum LandingError {
    /// The arena file cannot be opened or mapped from here (another host, another /dev/shm).
    #[error("landing arena {name} is not reachable from this process")]
    Unreachable {
        /// The arena's name.
        name: String,
        /// What the system said.
        #[source]
        source: io::Error,
    },
    /// A file of that name exists but is not the arena the descriptor describes.
    #[error("landing arena {0} is not the one the KV target describes")]
    Mismatch(String),
    /// The handoff does not fit the slot.
    #[error("handoff of {len} bytes does not fit the {capacity}-byte landing slot")]
    TooLarge {
        /// Bytes to write.
        len: u64,
        /// The slot's capacity.
        capacity: u64,
    },
    /// The descriptor's slot lies outside the arena.
    #[error("landing slot [{offset}, +{capacity}) lies outside the {arena_len}-byte arena")]
    OutOfBounds {
        /// The slot's offset.
        offset: u64,
        /// Its capacity.
        capacity: u64,
        /// The arena's length.
        arena_len: u64,
    },
    /// The slot's fence no longer holds the descriptor's token: its reservation let go (or
    /// another writer claimed it).
    #[error("the landing slot's reservation has ended (or another writer claimed it)")]
    Released,
}

/// A shared mapping of an arena file; unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, valid until drop; concurrent access goes
// through raw copies whose ranges the arena's allocator (or the descriptor) keeps apart.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers and copies.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of the open file `fd` shared, read-write.
    fn new(fd: libc::c_int, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping of an open descriptor; the kernel checks the arguments.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    fn read_u64(&self, at: usize) -> u64 {
        assert!(at + 8 <= self.len);
        // SAFETY: in bounds (asserted); unaligned read of plain bytes.
        unsafe { std::ptr::read_unaligned(self.ptr.add(at).cast::<u64>()) }
    }

    fn write_u64(&self, at: usize, v: u64) {
        assert!(at + 8 <= self.len);
        // SAFETY: in bounds (asserted); unaligned write of plain bytes.
        unsafe { std::ptr::write_unaligned(self.ptr.add(at).cast::<u64>(), v) }
    }

    /// The fence word at `at` (8-aligned, in bounds), shared with other processes.
    fn fence(&self, at: usize) -> &AtomicU64 {
        assert!(
            at.is_multiple_of(8) && at + 8 <= self.len,
            "a fence word lies in the table"
        );
        // SAFETY: in bounds and 8-aligned (asserted; the mapping is page-aligned), valid as
        // long as `self`; every process touches fence words only through atomics.
        unsafe { &*self.ptr.add(at).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// An open file descriptor, closed on drop.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: an fd this process opened, closed once.
        unsafe { libc::close(self.0) };
    }
}

fn shm_open(name: &str, flags: libc::c_int) -> io::Result<Fd> {
    let c = CString::new(format!("/{name}")).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: a NUL-terminated name; the kernel checks the flags.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Fd(fd))
}

fn shm_unlink(name: &str) {
    if let Ok(c) = CString::new(format!("/{name}")) {
        // SAFETY: a NUL-terminated name; failure (already gone) is harmless.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Free bytes of the filesystem holding /dev/shm.
fn shm_free_bytes() -> io::Result<u64> {
    let path = CString::new("/dev/shm").map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: statvfs fills the struct it is given; zeroed is a valid starting value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Removes arenas left in /dev/shm by decode workers that died without cleaning up.
fn remove_stale_arenas() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            tracing::info!(%name, "removing a KV landing arena left by a stopped worker");
            shm_unlink(&name);
        }
    }
}

#[derive(Default)]
struct Slots {
    /// Free ranges, offset → length, coalesced.
    free: BTreeMap<usize, usize>,
    /// Ranges released without their KV landing, with when they may be reused.
    quarantined: VecDeque<(Instant, usize, usize)>,
    in_use: usize,
}

impl Slots {
    fn release(&mut self, offset: usize, len: usize) {
        let (mut offset, mut len) = (offset, len);
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                offset = prev;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(offset + len)) {
            self.free.remove(&(offset + len));
            len += next_len;
        }
        self.free.insert(offset, len);
    }

    fn reclaim(&mut self, now: Instant) {
        while self
            .quarantined
            .front()
            .is_some_and(|(at, _, _)| *at <= now)
        {
            if let Some((_, offset, len)) = self.quarantined.pop_front() {
                self.release(offset, len);
            }
        }
    }

    /// First fit.
    fn take(&mut self, len: usize) -> Option<usize> {
        let (&offset, &have) = self.free.iter().find(|(_, &have)| have >= len)?;
        self.free.remove(&offset);
        if have > len {
            self.free.insert(offset + len, have - len);
        }
        self.in_use += len;
        Some(offset)
    }
}

/// The decode worker's shared-memory arena of landing slots (see the module docs).
pub struct LandingArena {
    name: String,
    nonce: u64,
    map: Mapping,
    /// Set once the transport registered the arena.
    remote: std::sync::OnceLock<RemoteArena>,
    /// Where the fence table and the slots start.
    fences: usize,
    slots_at: usize,
    slots: Mutex<Slots>,
    quarantine: Duration,
}

impl std::fmt::Debug for LandingArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingArena")
            .field("name", &self.name)
            .field("len", &self.map.len)
            .finish()
    }
}

impl LandingArena {
    /// Creates an arena of `len` bytes (rounded up to pages, plus a header page) in /dev/shm.
    /// Fails when /dev/shm would keep less than 16 MiB free for other users.
    pub fn create(len: usize) -> io::Result<Arc<LandingArena>> {
        Self::with_quarantine(len, DEFAULT_QUARANTINE)
    }

    /// [`LandingArena::create`] with another quarantine for abandoned slots.
    pub fn with_quarantine(len: usize, quarantine: Duration) -> io::Result<Arc<LandingArena>> {
        remove_stale_arenas();
        let slot_bytes = len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        // One fence word per page a slot may start on.
        let fence_bytes = (slot_bytes / SLOT_ALIGN * 8).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let (fences, slots_at) = (HEADER_BYTES, HEADER_BYTES + fence_bytes);
        let total = slots_at + slot_bytes;
        let free = shm_free_bytes()?;
        if free < (total + SHM_HEADROOM) as u64 {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!(
                    "/dev/shm has {free} bytes free, a {total}-byte arena needs {} more kept free for others",
                    SHM_HEADROOM
                ),
            ));
        }
        let nonce: u64 = rand::random::<u64>() | 1;
        let name = format!("{NAME_PREFIX}{}-{nonce:016x}", std::process::id());
        let fd = shm_open(&name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let reserve = || -> io::Result<Mapping> {
            // SAFETY: an fd we just created; reserves the file's pages now.
            let rc = unsafe { libc::posix_fallocate(fd.0, 0, total as libc::off_t) };
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            Mapping::new(fd.0, total)
        };
        let map = match reserve() {
            Ok(map) => map,
            Err(e) => {
                shm_unlink(&name);
                return Err(e);
            }
        };
        map.write_u64(AT_MAGIC, MAGIC);
        map.write_u64(AT_NONCE, nonce);
        map.write_u64(AT_LEN, total as u64);
        map.write_u64(AT_FENCES, fences as u64);
        map.write_u64(AT_SLOTS, slots_at as u64);
        let mut slots = Slots::default();
        slots.release(slots_at, total - slots_at);
        tracing::info!(%name, bytes = total, "KV landing arena ready (shared memory for prefill workers on this host)");
        Ok(Arc::new(LandingArena {
            name,
            nonce,
            map,
            remote: std::sync::OnceLock::new(),
            fences,
            slots_at,
            slots: Mutex::new(slots),
            quarantine,
        }))
    }

    /// A slot of at least `len` bytes, or `None` while the arena has no room (the transfer
    /// then travels over the transport).
    pub fn slot(self: &Arc<Self>, len: usize) -> Option<LandingSlot> {
        let len = len.max(1).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let mut slots = self.slots.lock();
        slots.reclaim(Instant::now());
        let offset = slots.take(len)?;
        let fence = fresh_token();
        self.fence_of(offset).store(fence, Ordering::Release);
        Some(LandingSlot {
            arena: Arc::clone(self),
            offset,
            len,
            fence,
            landed: false,
        })
    }

    /// The fence word of the slot starting at `offset`.
    fn fence_of(&self, offset: usize) -> &AtomicU64 {
        self.map
            .fence(fence_at(self.fences, self.slots_at, offset as u64).expect("a slot's offset"))
    }

    /// Bytes held by live slots (quarantined ones not counted).
    pub fn bytes_in_use(&self) -> usize {
        let slots = self.slots.lock();
        slots.in_use
    }

    /// The arena's file name in /dev/shm.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The mapping's address and length (what the transport registers).
    pub(crate) fn region(&self) -> (*mut u8, usize) {
        (self.map.ptr, self.map.len)
    }

    /// Records the arena's registration with the transport; descriptors made from then on
    /// carry it. A second registration is ignored.
    pub fn set_remote(&self, remote: RemoteArena) {
        let _ = self.remote.set(remote);
    }
}

impl Drop for LandingArena {
    fn drop(&mut self) {
        shm_unlink(&self.name);
    }
}

/// One reservation's part of a [`LandingArena`]; released when dropped (at once if its KV
/// landed, after the quarantine otherwise).
pub struct LandingSlot {
    arena: Arc<LandingArena>,
    offset: usize,
    len: usize,
    fence: u64,
    landed: bool,
}

impl std::fmt::Debug for LandingSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingSlot")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl LandingSlot {
    /// The descriptor a writer needs; writes through it succeed while this slot is held.
    pub fn landing(&self) -> Landing {
        Landing {
            name: self.arena.name.clone(),
            nonce: self.arena.nonce,
            arena_len: self.arena.map.len as u64,
            offset: self.offset as u64,
            capacity: self.len as u64,
            fence: self.fence,
            fence_offset: fence_at(self.arena.fences, self.arena.slots_at, self.offset as u64)
                .expect("a slot's offset") as u64,
            remote: self.arena.remote.get().cloned(),
        }
    }

    /// A new token in the slot's fence (a claim of the old one is void) and the descriptor
    /// with it: for reusing one slot for several handoffs in turn (benchmarks), each after
    /// the previous one's bytes were read.
    pub fn rearm(&mut self) -> Landing {
        self.fence = fresh_token();
        self.arena
            .fence_of(self.offset)
            .store(self.fence, Ordering::Release);
        self.landing()
    }

    /// The slot's offset in its arena.
    pub fn offset(&self) -> u64 {
        self.offset as u64
    }

    /// The first `len` bytes written into the slot, once a completion record said they
    /// landed (`None` when `len` exceeds the slot). Marks the slot landed: it is reused at
    /// once when dropped.
    ///
    /// The bytes are shared memory: only a writer that ignored the fencing rules could
    /// change them while they are read, and the checksums the decode side verifies over them
    /// would then fail.
    pub fn landed(&mut self, len: usize) -> Option<&[u8]> {
        if len > self.len {
            return None;
        }
        self.landed = true;
        Some(self.bytes(len))
    }

    /// The slot's first `len <= self.len` bytes.
    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.len, "past the slot");
        // SAFETY: [offset, offset + len) lies inside the mapping (the allocator handed out
        // [offset, offset + self.len)), which lives as long as `self.arena`.
        unsafe { std::slice::from_raw_parts(self.arena.map.ptr.add(self.offset), len) }
    }
}

impl LandingSlot {
    /// [`LandingSlot::landed`], keeping the slot: the bytes stay readable (and the slot held)
    /// as long as the returned value lives.
    pub fn into_landed(mut self, len: usize) -> Option<LandedBytes> {
        self.landed(len)?;
        Some(LandedBytes { slot: self, len })
    }
}

/// The bytes of a slot whose handoff landed (see [`LandingSlot::into_landed`]); the slot is
/// released when this is dropped.
#[derive(Debug)]
pub struct LandedBytes {
    slot: LandingSlot,
    len: usize,
}

impl AsRef<[u8]> for LandedBytes {
    fn as_ref(&self) -> &[u8] {
        self.slot.bytes(self.len)
    }
}

impl Drop for LandingSlot {
    fn drop(&mut self) {
        // From here on no writer starts a copy into this slot.
        self.arena.fence_of(self.offset).store(0, Ordering::Release);
        let mut slots = self.arena.slots.lock();
        slots.in_use -= self.len;
        if self.landed {
            slots.release(self.offset, self.len);
        } else {
            let until = Instant::now() + self.arena.quarantine;
            slots.quarantined.push_back((until, self.offset, self.len));
        }
    }
}

/// The value a slot's fence holds once a writer claimed it from `token`.
pub fn claimed(token: u64) -> u64 {
    !token
}

/// A fresh fence token: odd (never 0) with the top bit clear, so its claimed form is neither
/// 0 nor a token.
fn fresh_token() -> u64 {
    (rand::random::<u64>() | 1) & !(1 << 63)
}

/// Where the fence word of the slot starting at `offset` lies, for an arena whose fence table
/// starts at `fences` and whose slots start at `slots_at`; `None` for an offset no slot can
/// start at.
fn fence_at(fences: usize, slots_at: usize, offset: u64) -> Option<usize> {
    let page = (offset as usize).checked_sub(slots_at)?;
    page.is_multiple_of(SLOT_ALIGN)
        .then_some(fences + page / SLOT_ALIGN * 8)
}

/// The prefill side: writes handoffs into landing slots of arenas it can map, keeping the
/// last few arenas mapped.
#[derive(Default)]
pub struct LandingWriter {
    maps: Mutex<HashMap<(String, u64), Arc<Mapping>>>,
}

impl std::fmt::Debug for LandingWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingWriter").finish_non_exhaustive()
    }
}

impl LandingWriter {
    /// A writer with no arena mapped yet.
    pub fn new() -> LandingWriter {
        LandingWriter::default()
    }

    /// Copies `payload` into the slot `to` describes. On error nothing was written: send the
    /// handoff another way.
    pub fn write(&self, to: &Landing, payload: &[u8]) -> Result<(), LandingError> {
        self.write_with(to, payload.len(), |dst| dst.copy_from_slice(payload))
    }

    /// Lets `fill` write the first `len` bytes of the slot `to` describes (e.g. encode a
    /// message straight into it). `fill` only runs when the slot can take them; on error
    /// nothing was written.
    pub fn write_with(
        &self,
        to: &Landing,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), LandingError> {
        if len as u64 > to.capacity {
            return Err(LandingError::TooLarge {
                len: len as u64,
                capacity: to.capacity,
            });
        }
        let out_of_bounds = || LandingError::OutOfBounds {
            offset: to.offset,
            capacity: to.capacity,
            arena_len: to.arena_len,
        };
        if to.offset < HEADER_BYTES as u64
            || to
                .offset
                .checked_add(to.capacity)
                .is_none_or(|end| end > to.arena_len)
        {
            return Err(out_of_bounds());
        }
        let map = self.mapping(to)?;
        let (fences, slots_at) = (
            map.read_u64(AT_FENCES) as usize,
            map.read_u64(AT_SLOTS) as usize,
        );
        let fence = fence_at(fences, slots_at, to.offset)
            .filter(|&at| at >= HEADER_BYTES && at + 8 <= slots_at)
            .ok_or_else(out_of_bounds)?;
        if to.fence == 0
            || map
                .fence(fence)
                .compare_exchange(
                    to.fence,
                    claimed(to.fence),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
        {
            return Err(LandingError::Released);
        }
        // SAFETY: [offset, offset + len) is inside the mapping (checked against arena_len,
        // which equals the mapping's length) and the mapping outlives the call; the decode
        // side does not touch the slot before the completion record sent after this write,
        // no other writer holds this slot's token, and a slot released while this copy runs
        // is quarantined far longer than the copy takes.
        let dst = unsafe { std::slice::from_raw_parts_mut(map.ptr.add(to.offset as usize), len) };
        fill(dst);
        Ok(())
    }

    fn mapping(&self, to: &Landing) -> Result<Arc<Mapping>, LandingError> {
        let key = (to.name.clone(), to.nonce);
        if let Some(m) = self.maps.lock().get(&key) {
            return Ok(Arc::clone(m));
        }
        let unreachable = |source| LandingError::Unreachable {
            name: to.name.clone(),
            source,
        };
        let fd = shm_open(&to.name, libc::O_RDWR).map_err(unreachable)?;
        // SAFETY: fstat fills the struct it is given; zeroed is a valid starting value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: an open fd and a valid out-pointer.
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Err(unreachable(io::Error::last_os_error()));
        }
        if st.st_size as u64 != to.arena_len {
            return Err(LandingError::Mismatch(to.name.clone()));
        }
        let map = Mapping::new(fd.0, to.arena_len as usize).map_err(unreachable)?;
        if map.read_u64(AT_MAGIC) != MAGIC || map.read_u64(AT_NONCE) != to.nonce {
            return Err(LandingError::Mismatch(to.name.clone()));
        }
        let map = Arc::new(map);
        let mut maps = self.maps.lock();
        if maps.len() >= WRITER_CACHE {
            maps.clear(); // decode workers come and go; remapping is cheap
        }
        maps.insert(key, Arc::clone(&map));
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_write_lands_in_the_slot_and_nowhere_else() {
        let arena = LandingArena::create(4 * MIB).expect("arena");
        let mut a = arena.slot(MIB).expect("slot a");
        let mut b = arena.slot(MIB).expect("slot b");
        let writer = LandingWriter::new();
        let payload: Vec<u8> = (0..MIB - 5).map(|i| (i % 253) as u8).collect();
        writer.write(&a.landing(), &payload).expect("write a");
        writer.write(&b.landing(), &[7u8; 100]).expect("write b");
        assert!(a.landed(payload.len()).expect("fits") == &payload[..]);
        assert_eq!(b.landed(100).expect("fits"), &[7u8; 100]);
        assert!(a.landed(MIB + 1).is_none(), "past the slot");
    }

    #[test]
    fn writers_refuse_what_does_not_fit_or_is_not_held_or_is_another_arena() {
        let arena = LandingArena::create(2 * MIB).expect("arena");
        let slot = arena.slot(4096).expect("slot");
        let writer = LandingWriter::new();
        let to = slot.landing();
        assert!(matches!(
            writer.write(&to, &vec![0u8; 4097]),
            Err(LandingError::TooLarge { .. })
        ));
        let forged = Landing {
            fence: to.fence ^ 2,
            ..to.clone()
        };
        assert!(matches!(
            writer.write(&forged, b"x"),
            Err(LandingError::Released)
        ));
        let other = Landing {
            nonce: to.nonce ^ 2,
            ..to.clone()
        };
        assert!(matches!(
            writer.write(&other, b"x"),
            Err(LandingError::Mismatch(_))
        ));
        let gone = Landing {
            name: format!("{NAME_PREFIX}0-none"),
            ..to.clone()
        };
        assert!(matches!(
            writer.write(&gone, b"x"),
            Err(LandingError::Unreachable { .. })
        ));
        let outside = Landing {
            offset: to.arena_len - 4096,
            capacity: 8192,
            ..to.clone()
        };
        assert!(matches!(
            writer.write(&outside, b"x"),
            Err(LandingError::OutOfBounds { .. })
        ));
        let misaligned = Landing {
            offset: to.offset + 8,
            capacity: 64,
            ..to.clone()
        };
        assert!(matches!(
            writer.write(&misaligned, b"x"),
            Err(LandingError::OutOfBounds { .. })
        ));
        writer
            .write(&to, b"ok")
            .expect("the real descriptor still writes");
        assert!(
            matches!(writer.write(&to, b"twice"), Err(LandingError::Released)),
            "a slot takes one writer: the first claimed it"
        );
    }

    /// The stale-writer race: once a reservation lets go of its slot (its lease ran out, it
    /// was cancelled), a writer holding its descriptor writes nothing — even when the slot has
    /// since been handed to another reservation, whose bytes stay as they were.
    #[test]
    fn a_released_slot_takes_no_writes_from_its_old_descriptor() {
        let arena = LandingArena::with_quarantine(MIB, Duration::ZERO).expect("arena");
        let writer = LandingWriter::new();
        let first = arena.slot(MIB).expect("slot");
        let stale = first.landing();
        drop(first);
        assert!(matches!(
            writer.write(&stale, b"late"),
            Err(LandingError::Released)
        ));
        let mut second = arena.slot(MIB).expect("the same range, reused");
        let fresh = second.landing();
        assert_eq!(fresh.offset, stale.offset, "the test reuses the range");
        assert_ne!(fresh.fence, stale.fence);
        writer.write(&fresh, b"mine").expect("write");
        assert!(matches!(
            writer.write(&stale, b"late"),
            Err(LandingError::Released)
        ));
        assert_eq!(second.landed(4).expect("fits"), b"mine");
    }

    #[test]
    fn abandoned_slots_wait_out_the_quarantine_landed_ones_do_not() {
        let arena =
            LandingArena::with_quarantine(2 * MIB, Duration::from_secs(3600)).expect("arena");
        let whole = 2 * MIB; // every byte after the header
        let mut landed = arena.slot(whole).expect("the whole arena");
        assert!(arena.slot(4096).is_none(), "full");
        landed.landed(10);
        drop(landed);
        let abandoned = arena.slot(whole).expect("reused at once after landing");
        drop(abandoned);
        assert!(
            arena.slot(4096).is_none(),
            "an abandoned slot is not handed out before its quarantine ends"
        );
        let short = LandingArena::with_quarantine(2 * MIB, Duration::ZERO).expect("arena");
        drop(short.slot(whole).expect("slot"));
        assert!(
            short.slot(whole).is_some(),
            "reclaimed once the quarantine is over"
        );
    }

    #[test]
    fn free_ranges_coalesce() {
        let arena = LandingArena::create(3 * MIB).expect("arena");
        let mut s: Vec<LandingSlot> = (0..3).map(|_| arena.slot(MIB).expect("slot")).collect();
        for slot in &mut s {
            slot.landed(0);
        }
        // Free the middle, then the ends: one 3 MiB range again.
        let last = s.pop().expect("three");
        let middle = s.pop().expect("three");
        drop(middle);
        drop(s);
        drop(last);
        assert!(arena.slot(3 * MIB).is_some());
        assert_eq!(arena.bytes_in_use(), 0);
    }

    #[test]
    fn the_arena_file_goes_with_the_arena() {
        let arena = LandingArena::create(MIB).expect("arena");
        let path = format!("/dev/shm/{}", arena.name());
        assert!(std::path::Path::new(&path).exists());
        drop(arena);
        assert!(!std::path::Path::new(&path).exists());
    }
}
