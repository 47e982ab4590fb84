//! Classic pcap capture files (the libpcap format that `tcpdump -w` writes
//! and Wireshark opens), so the simulated fabric can record what it carries.
//!
//! Contract:
//! - [`PcapWriter`] writes the 24-byte global header when created (magic
//!   0xa1b2c3d4 stored little-endian, version 2.4, thiszone 0, sigfigs 0,
//!   snaplen 65535, linktype 1 = Ethernet), then one 16-byte record header
//!   and the frame per [`PcapWriter::write_frame`]. Timestamps are the
//!   caller's (simulated) nanoseconds, stored as seconds + microseconds.
//!   Frames longer than the snaplen are cut to it, keeping the original
//!   length in the record. The writer adds no buffering and allocates
//!   nothing per frame: wrap a file in a `BufWriter`.
//! - [`PcapReader`] walks a capture held in memory (for tests). It accepts
//!   exactly what the writer produces — little-endian, microsecond
//!   resolution, version 2.4 — and rejects anything else, and any
//!   inconsistent or truncated record, with a [`PcapError`]; it never panics.

use std::io::{self, Write};

use ib_types::abi::{Le16, Le32, LeI32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::wire::assert_layout;

/// The microsecond-resolution pcap magic number.
pub const MAGIC: u32 = 0xA1B2_C3D4;
/// The largest frame a record holds in full.
pub const SNAPLEN: u32 = 65_535;
/// The link type of Ethernet (`LINKTYPE_ETHERNET`).
pub const LINKTYPE_ETHERNET: u32 = 1;

/// Nanoseconds per second and per microsecond.
const NS_PER_S: u64 = 1_000_000_000;
const NS_PER_US: u64 = 1_000;

/// The file header.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct PcapFileHeader {
    /// [`MAGIC`], in the writer's byte order (little-endian here).
    pub magic: Le32,
    /// Major version, 2.
    pub version_major: Le16,
    /// Minor version, 4.
    pub version_minor: Le16,
    /// Offset of local time from UTC, in seconds (0).
    pub thiszone: LeI32,
    /// Timestamp accuracy (0).
    pub sigfigs: Le32,
    /// The largest captured length of a record.
    pub snaplen: Le32,
    /// The link type of every record.
    pub network: Le32,
}
assert_layout!(
    PcapFileHeader,
    size = 24,
    magic @ 0,
    version_major @ 4,
    version_minor @ 6,
    thiszone @ 8,
    sigfigs @ 12,
    snaplen @ 16,
    network @ 20,
);

/// The header before each captured frame.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct PcapRecordHeader {
    /// Seconds of the timestamp.
    pub ts_sec: Le32,
    /// Microseconds of the timestamp (below 1,000,000).
    pub ts_usec: Le32,
    /// Bytes captured in the file.
    pub incl_len: Le32,
    /// Bytes of the frame on the wire.
    pub orig_len: Le32,
}
assert_layout!(PcapRecordHeader, size = 16, ts_sec @ 0, ts_usec @ 4, incl_len @ 8, orig_len @ 12);

/// Writes a pcap capture to `W`.
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    inner: W,
    frames: u64,
}

impl<W: Write> PcapWriter<W> {
    /// Writes the file header to `inner`.
    pub fn new(mut inner: W) -> io::Result<Self> {
        let header = PcapFileHeader {
            magic: Le32::new(MAGIC),
            version_major: Le16::new(2),
            version_minor: Le16::new(4),
            thiszone: LeI32::new(0),
            sigfigs: Le32::new(0),
            snaplen: Le32::new(SNAPLEN),
            network: Le32::new(LINKTYPE_ETHERNET),
        };
        inner.write_all(header.as_bytes())?;
        Ok(Self { inner, frames: 0 })
    }

    /// Appends one frame seen at `timestamp_ns` (nanoseconds since the
    /// epoch of the simulation; pcap keeps microseconds). Fails with
    /// `InvalidInput` if the seconds do not fit the format's 32 bits.
    pub fn write_frame(&mut self, timestamp_ns: u64, frame: &[u8]) -> io::Result<()> {
        let ts_sec = u32::try_from(timestamp_ns / NS_PER_S).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "pcap timestamp beyond 2^32 seconds",
            )
        })?;
        let orig_len = u32::try_from(frame.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame longer than 4 GiB"))?;
        let incl_len = orig_len.min(SNAPLEN);
        let record = PcapRecordHeader {
            ts_sec: Le32::new(ts_sec),
            // Below 10^6, so it fits.
            ts_usec: Le32::new(((timestamp_ns % NS_PER_S) / NS_PER_US) as u32),
            incl_len: Le32::new(incl_len),
            orig_len: Le32::new(orig_len),
        };
        self.inner.write_all(record.as_bytes())?;
        self.inner.write_all(&frame[..incl_len as usize])?;
        self.frames += 1;
        Ok(())
    }

    /// Frames written so far.
    pub const fn frames(&self) -> u64 {
        self.frames
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }

    /// The underlying writer.
    pub const fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Gives back the underlying writer (not flushed).
    pub fn into_inner(self) -> W {
        self.inner
    }
}

/// Why a capture could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PcapError {
    /// The capture ends inside a header or a frame.
    #[error("{what}: truncated, need {needed} bytes, got {got}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes left.
        got: usize,
    },
    /// Not a little-endian, microsecond-resolution capture.
    #[error("unsupported pcap magic {found:#010x}")]
    BadMagic {
        /// The magic read little-endian.
        found: u32,
    },
    /// Not version 2.4.
    #[error("unsupported pcap version {major}.{minor}")]
    BadVersion {
        /// Major version found.
        major: u16,
        /// Minor version found.
        minor: u16,
    },
    /// A record claims more bytes than the snaplen or its original length.
    #[error("record {index}: captured {incl_len} bytes of {orig_len} (snaplen {snaplen})")]
    BadRecordLength {
        /// The record's index, from 0.
        index: u64,
        /// Captured length.
        incl_len: u32,
        /// Original length.
        orig_len: u32,
        /// The file's snaplen.
        snaplen: u32,
    },
    /// A record's microseconds are not below one second.
    #[error("record {index}: {usec} microseconds")]
    BadTimestamp {
        /// The record's index, from 0.
        index: u64,
        /// The microseconds found.
        usec: u32,
    },
}

/// One captured frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PcapRecord<'a> {
    /// The timestamp, in nanoseconds (microsecond resolution).
    pub timestamp_ns: u64,
    /// The captured bytes.
    pub data: &'a [u8],
    /// The frame's length on the wire.
    pub orig_len: u32,
}

/// Reads the records of a capture held in memory.
#[derive(Debug, Clone)]
pub struct PcapReader<'a> {
    header: PcapFileHeader,
    rest: &'a [u8],
    index: u64,
    failed: bool,
}

impl<'a> PcapReader<'a> {
    /// Checks the file header.
    pub fn new(bytes: &'a [u8]) -> Result<Self, PcapError> {
        let (header, rest) =
            PcapFileHeader::read_from_prefix(bytes).map_err(|_| PcapError::Truncated {
                what: "file header",
                needed: size_of::<PcapFileHeader>(),
                got: bytes.len(),
            })?;
        if header.magic.get() != MAGIC {
            return Err(PcapError::BadMagic {
                found: header.magic.get(),
            });
        }
        let (major, minor) = (header.version_major.get(), header.version_minor.get());
        if (major, minor) != (2, 4) {
            return Err(PcapError::BadVersion { major, minor });
        }
        Ok(Self {
            header,
            rest,
            index: 0,
            failed: false,
        })
    }

    /// The link type of every record.
    pub fn linktype(&self) -> u32 {
        self.header.network.get()
    }

    /// The capture's snaplen.
    pub fn snaplen(&self) -> u32 {
        self.header.snaplen.get()
    }

    /// The file header as read.
    pub const fn header(&self) -> &PcapFileHeader {
        &self.header
    }

    fn next_record(&mut self) -> Result<PcapRecord<'a>, PcapError> {
        let (record, rest) =
            PcapRecordHeader::read_from_prefix(self.rest).map_err(|_| PcapError::Truncated {
                what: "record header",
                needed: size_of::<PcapRecordHeader>(),
                got: self.rest.len(),
            })?;
        let (incl_len, orig_len) = (record.incl_len.get(), record.orig_len.get());
        let snaplen = self.snaplen();
        if incl_len > snaplen || incl_len > orig_len {
            return Err(PcapError::BadRecordLength {
                index: self.index,
                incl_len,
                orig_len,
                snaplen,
            });
        }
        let usec = record.ts_usec.get();
        if u64::from(usec) >= NS_PER_S / NS_PER_US {
            return Err(PcapError::BadTimestamp {
                index: self.index,
                usec,
            });
        }
        let len = incl_len as usize;
        let data = rest.get(..len).ok_or(PcapError::Truncated {
            what: "record data",
            needed: len,
            got: rest.len(),
        })?;
        self.rest = &rest[len..];
        self.index += 1;
        Ok(PcapRecord {
            timestamp_ns: u64::from(record.ts_sec.get()) * NS_PER_S + u64::from(usec) * NS_PER_US,
            data,
            orig_len,
        })
    }
}

impl<'a> Iterator for PcapReader<'a> {
    type Item = Result<PcapRecord<'a>, PcapError>;

    /// The next record; after an error, `None`.
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let result = self.next_record();
        self.failed = result.is_err();
        Some(result)
    }
}

impl core::iter::FusedIterator for PcapReader<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn file_header_literal() {
        let writer = PcapWriter::new(Vec::new()).unwrap();
        assert_eq!(
            writer.get_ref().as_slice(),
            [
                0xD4, 0xC3, 0xB2, 0xA1, // magic, little-endian
                0x02, 0x00, 0x04, 0x00, // version 2.4
                0x00, 0x00, 0x00, 0x00, // thiszone
                0x00, 0x00, 0x00, 0x00, // sigfigs
                0xFF, 0xFF, 0x00, 0x00, // snaplen 65535
                0x01, 0x00, 0x00, 0x00, // Ethernet
            ]
        );
    }

    #[test]
    fn record_literal() {
        let mut writer = PcapWriter::new(Vec::new()).unwrap();
        writer.write_frame(3_000_123_456, &[0xAA, 0xBB]).unwrap();
        assert_eq!(writer.frames(), 1);
        let bytes = writer.into_inner();
        assert_eq!(
            &bytes[24..],
            [
                0x03, 0x00, 0x00, 0x00, // 3 s
                0x7B, 0x00, 0x00, 0x00, // 123 us (456 ns dropped)
                0x02, 0x00, 0x00, 0x00, // captured 2
                0x02, 0x00, 0x00, 0x00, // original 2
                0xAA, 0xBB,
            ]
        );
        let mut reader = PcapReader::new(&bytes).unwrap();
        assert_eq!(reader.linktype(), LINKTYPE_ETHERNET);
        assert_eq!(reader.snaplen(), SNAPLEN);
        let record = reader.next().unwrap().unwrap();
        assert_eq!(record.timestamp_ns, 3_000_123_000);
        assert_eq!(record.data, [0xAA, 0xBB]);
        assert!(reader.next().is_none());
    }

    #[test]
    fn long_frames_are_cut_to_the_snaplen() {
        let mut writer = PcapWriter::new(Vec::new()).unwrap();
        let frame = vec![7u8; SNAPLEN as usize + 10];
        writer.write_frame(0, &frame).unwrap();
        let bytes = writer.into_inner();
        let record = PcapReader::new(&bytes).unwrap().next().unwrap().unwrap();
        assert_eq!(record.data.len(), SNAPLEN as usize);
        assert_eq!(record.orig_len as usize, frame.len());
    }

    #[test]
    fn timestamps_beyond_the_format_are_refused() {
        let mut writer = PcapWriter::new(Vec::new()).unwrap();
        let too_late = (u64::from(u32::MAX) + 1) * NS_PER_S;
        let err = writer.write_frame(too_late, &[1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(writer.frames(), 0);
        assert_eq!(writer.get_ref().len(), 24, "nothing written");
    }

    #[test]
    fn bad_captures_are_rejected() {
        let mut writer = PcapWriter::new(Vec::new()).unwrap();
        writer.write_frame(1, &[1, 2, 3]).unwrap();
        let good = writer.into_inner();

        let with = |f: fn(&mut Vec<u8>)| {
            let mut bytes = good.clone();
            f(&mut bytes);
            bytes
        };
        assert!(matches!(
            PcapReader::new(&good[..23]),
            Err(PcapError::Truncated { .. })
        ));
        assert_eq!(
            PcapReader::new(&with(|b| b[0..4].copy_from_slice(&MAGIC.to_be_bytes()))).unwrap_err(),
            PcapError::BadMagic { found: 0xD4C3_B2A1 }
        );
        assert_eq!(
            PcapReader::new(&with(|b| b[6] = 3)).unwrap_err(),
            PcapError::BadVersion { major: 2, minor: 3 }
        );

        fn first(bytes: &[u8]) -> Result<PcapRecord<'_>, PcapError> {
            PcapReader::new(bytes).unwrap().next().unwrap()
        }
        assert!(matches!(
            first(&with(|b| b.truncate(24 + 16 + 2))),
            Err(PcapError::Truncated {
                what: "record data",
                ..
            })
        ));
        assert!(matches!(
            first(&with(|b| b.truncate(24 + 15))),
            Err(PcapError::Truncated {
                what: "record header",
                ..
            })
        ));
        assert!(matches!(
            first(&with(|b| b[32] = 4)), // incl_len 4 > orig_len 3
            Err(PcapError::BadRecordLength { .. })
        ));
        assert!(matches!(
            first(&with(
                |b| b[28..32].copy_from_slice(&1_000_000u32.to_le_bytes())
            )),
            Err(PcapError::BadTimestamp { .. })
        ));

        // After an error the reader stops.
        let bad = with(|b| b[32] = 4);
        let mut reader = PcapReader::new(&bad).unwrap();
        assert!(reader.next().unwrap().is_err());
        assert!(reader.next().is_none());
    }

    proptest! {
        #[test]
        fn write_then_read(frames in proptest::collection::vec(
            (0u64..1 << 40, proptest::collection::vec(any::<u8>(), 0..100)), 0..10)
        ) {
            let mut writer = PcapWriter::new(Vec::new()).unwrap();
            for (ts, frame) in &frames {
                writer.write_frame(*ts, frame).unwrap();
            }
            let bytes = writer.into_inner();
            let read: Vec<_> = PcapReader::new(&bytes).unwrap().collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(read.len(), frames.len());
            for (record, (ts, frame)) in read.iter().zip(&frames) {
                prop_assert_eq!(record.timestamp_ns, ts / 1000 * 1000);
                prop_assert_eq!(record.data, &frame[..]);
            }
        }

        #[test]
        fn reader_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            let mut capture = PcapWriter::new(Vec::new()).unwrap().into_inner();
            capture.extend_from_slice(&bytes);
            if let Ok(reader) = PcapReader::new(&capture) {
                for _ in reader {}
            }
            let _ = PcapReader::new(&bytes).map(|r| r.count());
        }
    }
}
