//! Who may hold the server's connections: at most `per_client` from one address, and the
//! last `reserve` of them only for an address that holds none. A slowloris client (many
//! connections sending their headers a byte at a time until `--header-timeout`) can then
//! take no more than its share, and a new client (a load balancer's `/health` probe, a
//! person) still gets in while the rest are held. nginx's `limit_conn` per `$binary_remote_addr`
//! is the same rule; the reserve is lathe's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Open connections per client address.
#[derive(Debug)]
pub struct ClientCounts {
    per_client: usize,
    reserve: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted connection; dropping it gives the address's place back.
#[derive(Debug)]
pub struct ClientSlot {
    counts: Arc<ClientCounts>,
    ip: IpAddr,
}

impl ClientCounts {
    /// `max_connections` slots in all, of which the last eighth (at least one when there are
    /// two or more) are kept for new addresses.
    pub fn new(max_connections: usize, per_client: usize) -> Arc<ClientCounts> {
        let reserve = if max_connections >= 2 {
            (max_connections / 8).max(1)
        } else {
            0
        };
        Arc::new(ClientCounts {
            per_client,
            reserve,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// Admits a connection from `ip` when `free` slots (this one's not yet counted out)
    /// remain, or says why not.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, free: usize) -> Result<ClientSlot, &'static str> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.get(&ip).copied().unwrap_or(0);
        if n >= self.per_client {
            return Err("too many connections from this address (--max-client-connections)");
        }
        if n > 0 && free <= self.reserve {
            return Err(
                "the server's connections are nearly all held; the rest are kept for other clients",
            );
        }
        *open.entry(ip).or_insert(0) += 1;
        Ok(ClientSlot {
            counts: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// What a refused connection gets before it is closed.
pub fn refusal(why: &str) -> String {
    let body = format!("{{\"error\":{{\"message\":\"{why}\",\"type\":\"server_busy\"}}}}");
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_gets_its_share_and_new_addresses_the_reserve() {
        let counts = ClientCounts::new(16, 4);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "127.0.0.2".parse().unwrap(),
            "127.0.0.3".parse().unwrap(),
            "::1".parse().unwrap(),
        );
        let mut held: Vec<ClientSlot> = (0..4).map(|i| counts.admit(a, 16 - i).unwrap()).collect();
        assert!(counts.admit(a, 12).is_err(), "a fifth from one address");
        // b holds connections too; with only the reserve (16 / 8 = 2) left it gets no more,
        // and a new address still does.
        held.push(counts.admit(b, 12).unwrap());
        assert!(counts.admit(b, 2).is_err());
        held.push(counts.admit(c, 2).unwrap());
        // Closing gives the place back.
        held.drain(..4);
        assert!(counts.admit(a, 12).is_ok());
        assert!(counts.open.lock().unwrap().get(&a).is_none());
    }
}
